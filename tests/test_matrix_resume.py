"""Bisecting the reference recipe's resume: `samebits bisect --resume-at K` and `samebits
matrix --bisect-failures` on a cell whose independent runs held and whose resume differs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from samebits.cli import main
from samebits.cli._recipe import matrix_program, recipe_program
from samebits.cli.matrix import render
from samebits.errors import ConfigError
from samebits.runners.bisect import bisect
from samebits.runners import matrix as M
from samebits.runners.verify import VerifyResult
from samebits.verdicts import Verdict

TINY = ["num_layers=2", "seq_len=32", "vocab_size=256"]


def _resume_diverged_verify(program, out, *, resume_at, **_kwargs):
    """verify's answer for a cell whose A and B agree and whose resumed run C differs
    (no runs made: the fault below is caught by verify in tests/test_precision.py)."""
    def check(verdict):
        return SimpleNamespace(verdict=verdict, incomplete=[], notes=[], to_dict=lambda: {"verdict": verdict})
    return VerifyResult(str(out), {"independent": check("identical"), "resume": check("diverged")}, {}, resume_at)


@pytest.mark.slow
def test_bisect_failures_bisects_a_resume_that_forgets_the_amax_history(tmp_path, monkeypatch):
    """FP8 delayed scaling whose amax histories are left out of the checkpoint (the planted
    fault ``fp8_save_amax_history=false``): the cell's runs repeat, its resume differs, and the
    bisection of the resume (A through, B resumed from a checkpoint of step 1, both real) ends
    at the state census of step 1 naming the histories, not at an op that reads them."""
    monkeypatch.setattr(M, "verify", _resume_diverged_verify)
    matrix = matrix_program(global_batch=2, overrides=[*TINY, "fp8_save_amax_history=false"])
    result = M.run_matrix(matrix, tmp_path / "m", cells=["single"], precisions=["fp8_delayed"], steps=2, resume_at=1,
                          bisect_failures=True)
    (cell,) = result.cells
    assert cell.verdict is Verdict.FAIL and (cell.check("independent"), cell.check("resume")) == ("yes", "no")
    found = json.loads(json.dumps(result.to_dict()))["cells"][0]["bisect"]
    assert found["of"] == "resume" and found["verdict"] == "diverged", found
    origin = found["origin"]
    assert (origin["kind"], origin["step"], origin["rank"]) == ("resume_state", 1, 0), found
    assert origin["state_differs"] and all(name.startswith("fp8.") and ".amax_history_" in name
                                           for name in origin["state_differs"]), origin["state_differs"]
    assert "checkpoint does not save or restore them" in found["conclusion"]
    assert "single fp8_delayed, bisect of the resume: the resumed run starts step 1" in render(result)


def test_resume_bisect_arguments_are_checked_before_any_run(tmp_path):
    with pytest.raises(ConfigError, match="--b-step-offset"):
        bisect(["python", "train.py"], out=tmp_path / "a", resume_at=1)
    with pytest.raises(ConfigError, match="between 1 and 3"):
        bisect(out=tmp_path / "b", program=recipe_program(2, steps=4), resume_at=4)
    assert main(["bisect", "--out", str(tmp_path / "c"), "--resume-at", "0", "--steps", "3"]) == 2
    assert not any(p.exists() for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c"))
