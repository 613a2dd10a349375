"""`samebits bisect -- python SCRIPT` on scripts written like a new user's (no samebits import,
tiny model, 2 threads, a few steps): each planted fault class gets the right conclusion.

The scripts are in tests/scripts_bisect/; each marks its planted line with ``# PLANTED``.
Each test is one end-to-end bisect (30-70 s on 2 busy cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from samebits.checkpoint import describe_state_record
from samebits.cli import main
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN

SCRIPTS = Path(__file__).resolve().parent / "scripts_bisect"
INDEX_PUT = ("aten::index_put", "aten::index_put_", "aten::_index_put_impl_")


def planted_line(name: str) -> str:
    """``script.py:LINE`` of the line marked ``# PLANTED``."""
    lines = (SCRIPTS / name).read_text().splitlines()
    return f"{name}:{next(i for i, line in enumerate(lines, 1) if '# PLANTED' in line)}"


def bisect(capsys, tmp_path, *args) -> tuple[int, dict, str]:
    code = main(["bisect", "--out", str(tmp_path / "out"), "--json", "--run-timeout", "300", *args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out.strip() else {}, captured.err


def script_command(name: str, *args: str) -> list[str]:
    return ["--", sys.executable, str(SCRIPTS / name), *args]


def assert_no_false_claims(result: dict) -> None:
    text = json.dumps(result)
    assert "below the dispatcher" not in text
    assert result["origin"]["kind"] != "initial_state" or result["origin"]["step"] == 0


@pytest.mark.slow
def test_an_op_in_the_models_own_forward_and_its_backward(tmp_path, capsys):
    """`pooled[idx]` in the top-level forward: its backward (index_put_ accumulate) races.
    A race need not race again the same way in bisect's dumps (on a loaded 2-core machine the
    two threads often do not overlap, and a race that fired in an earlier step's backward is not
    localised when the traced pair parts later: a known gap, the closing note of issue 36): up to
    two more bisects are allowed while one ends unlocalised, never when it names something else."""
    code, result, err = bisect(capsys, tmp_path, *script_command("toplevel_index.py"))
    claims = {"op", "probe", "collective", "generator", "input_batch", "order", "initial_state", "replicas"}
    for again in ("again", "third"):
        if code != EXIT_BAD_VERDICT or (result.get("origin") or {}).get("kind") in claims:
            break
        (tmp_path / again).mkdir()
        code, result, err = bisect(capsys, tmp_path / again, *script_command("toplevel_index.py"))
    assert code == EXIT_BAD_VERDICT, err
    origin = result["origin"]
    assert origin["kind"] == "op" and origin["classification"] == "origin", result["conclusion"]
    assert origin["op"] in INDEX_PUT and origin["phase"] == "backward"
    assert origin["module"] == ""  # the root module's own forward, not a submodule
    assert origin["call_site"].endswith(planted_line("toplevel_index.py") + " in forward")
    # the race need not recur in the dumps: then the conclusion says so, and no element count
    if origin["elements"] is None:
        assert "did not reproduce the difference" in result["conclusion"], result["conclusion"]
    else:
        assert origin["elements"]["differing"] > 0
    assert_no_false_claims(result)


@pytest.mark.slow
def test_same_values_in_another_order_names_the_call(tmp_path, capsys):
    """Gradients gathered from a Python set (PYTHONHASHSEED differs per process)."""
    code, result, err = bisect(capsys, tmp_path, *script_command("set_order.py"))
    assert code == EXIT_BAD_VERDICT, err
    origin = result["origin"]
    assert origin["kind"] == "order", result["conclusion"]
    assert result["conclusion"].startswith("same values, different order")
    assert origin["op"] == "aten::cat"
    # the gradients were recorded before: cat's list argument's provenance shows the order
    assert "list argument 0 of /aten::cat:0 holds the same" in result["conclusion"]
    assert "all inputs" not in result["conclusion"]
    assert origin["call_site"].endswith(planted_line("set_order.py") + " in <module>")
    assert_no_false_claims(result)


def test_an_input_batch_that_differs_is_the_data_pipeline(tmp_path, capsys):
    """A shuffling sampler seeded from the clock: stop at the first stage, blame the data and
    the private generator that drew its order, by the line that made it (zero-code census)."""
    code, result, err = bisect(capsys, tmp_path, *script_command("data_shuffle.py"))
    assert code == EXIT_BAD_VERDICT, err
    assert result["origin"]["kind"] == "generator"
    assert result["origin"]["state_differs"] == ["rng.user.data_shuffle.py:13"]
    assert result["conclusion"].startswith("the private generator made at data_shuffle.py:13 is in another state")
    assert "the input batch differs at step 0" in result["conclusion"]
    assert "origin is before the model (data loader / dataset / sampler)" in result["conclusion"]
    assert [s["name"] for s in result["stages"]] == ["steps"]
    assert_no_false_claims(result)


@pytest.mark.slow
def test_an_rng_op_names_the_generator_that_differs(tmp_path, capsys):
    """Dropout after the global generator was reseeded from the clock."""
    code, result, err = bisect(capsys, tmp_path, *script_command("dropout_seed.py"))
    assert code == EXIT_BAD_VERDICT, err
    origin = result["origin"]
    assert origin["kind"] == "generator", result["conclusion"]
    assert origin["op"] in ("aten::bernoulli_", "aten::native_dropout", "aten::bernoulli")
    assert "rng.torch_cpu" in origin["state_differs"]
    assert result["conclusion"].startswith(describe_state_record("rng.torch_cpu"))
    # Python's and NumPy's generators are unseeded here too, but never feed an ATen op
    assert describe_state_record("rng.python") not in result["conclusion"]
    assert_no_false_claims(result)


@pytest.mark.slow
def test_a_rerun_that_diverges_earlier_is_traced_from_there(tmp_path, capsys, monkeypatch):
    """The n-th run fires at the step the schedule says: the steps stage sees step 2, the
    modules stage's re-run step 0 (untraced there): bisect must trace from step 0, never
    report the parameters at step 2 ("init") as the origin."""
    monkeypatch.setenv("RUN_COUNTER", str(tmp_path / "counter"))
    code, result, err = bisect(capsys, tmp_path, *script_command("scheduled_noise.py", "-,2,0,-,0,-,0,-,0,-"))
    assert code == EXIT_BAD_VERDICT, err
    origin = result["origin"]
    assert result["stages"][0]["finding"]["step"] == 2
    assert any("before the traced step 2" in note for note in result["notes"]), result["notes"]
    assert (origin["kind"], origin["step"], origin["op"], origin["phase"]) == ("op", 0, "aten::mul", "forward")
    assert origin["call_site"].endswith(planted_line("scheduled_noise.py") + " in forward")


@pytest.mark.slow
def test_a_race_at_a_random_step(tmp_path, capsys):
    """The real thing: index_put_ accumulate racing on about half of the steps."""
    code, result, err = bisect(capsys, tmp_path, *script_command("random_step.py"))
    assert code == EXIT_BAD_VERDICT, err
    origin = result["origin"]
    assert origin["category"] != "state", result["conclusion"]
    if origin["kind"] != "not_localised":  # three re-runs without the race firing is possible, and said
        assert origin["op"] in INDEX_PUT and origin["phase"] == "backward"
        assert origin["call_site"].endswith(planted_line("random_step.py") + " in forward")
    assert_no_false_claims(result)


def test_a_side_that_crashes_is_an_error_never_identical(tmp_path, capsys):
    """Both runs crash at the same step after closing their streams: exit 2, no verdict."""
    code, result, err = bisect(capsys, tmp_path, *script_command("crash_mid_run.py"))
    assert code == EXIT_CANNOT_RUN and result == {}
    assert "exited with code 1" in err and "out of data" in err


@pytest.mark.slow
def test_data_parallel_replicas_that_start_apart(tmp_path, capsys):
    """`manual_seed(seed + rank)` before the model: each run repeats itself bit for bit, but
    the replicas (same reduced gradients on every rank) hold different weights."""
    code, result, err = bisect(capsys, tmp_path, *script_command("per_rank_seed.py"))
    assert code == EXIT_BAD_VERDICT, err
    origin = result["origin"]
    assert origin["kind"] == "replicas" and result["conclusion"].startswith("replicas differ")
    assert origin["params"] == ["0.weight", "0.bias", "2.weight", "2.bias"] and origin["ranks"] == [0, 1]
