"""`samebits matrix`: cells x precisions, each verified (A, B, C) and compared with the baseline;
exit 0 only when every required cell ran and held; a cell that cannot start, or whose runs
differ, is caught with the reason."""

from __future__ import annotations

import json
import os
import struct
from types import SimpleNamespace

import pytest

from samebits.cli import main
from samebits.cli._recipe import matrix_program
from samebits.cli.matrix import render
from samebits.errors import ConfigError
from samebits.recipes.cells import ParallelDims, cell_name
from samebits.recipes.commands import cell_overrides
from samebits.runners import distance
from samebits.runners import matrix as M
from samebits.runners.verify import VerifyResult
from samebits.verdicts import Verdict

TINY = ["num_layers=2", "seq_len=32", "vocab_size=256"]
GLOBAL_BATCH = 2  # samples per step in every cell: the tiny model's micro-batch of 2 on one data-parallel rank


def test_cell_names():
    """The matrix reads cells in the recipe's one grammar (`ParallelDims.parse`)."""
    assert ParallelDims.parse("single") == ParallelDims() and ParallelDims().world_size == 1
    tp_dp = ParallelDims.parse("tp2-dp2")
    assert (tp_dp.world_size, tp_dp.dp, tp_dp.name) == (4, 2, "tp2-dp2")
    assert tp_dp.overrides() == ["pp=1", "dp_replicate=2", "dp_shard=1", "tp=2", "ep=1"]
    ep2 = ParallelDims.parse("ep2")
    assert ep2.world_size == 2 and "ep=2" in ep2.overrides()  # EP rides on DP
    assert ParallelDims.parse("pp2-fsdp2-tp2").world_size == 8
    assert ParallelDims.parse("pp2-fsdp2-tp2").sizes() == {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "ep": 1}
    assert ParallelDims.parse("ep2-tp2-pp2").name == "pp2-tp2-ep2"  # the canonical order
    assert cell_name(ParallelDims.parse("single").sizes()) == "single"
    for bad, message in [("tp", "names no parallel size|not one of"), ("tp2-tp2", "each at most once"),
                         ("ep2-dp4", "must equal dp's size"), ("cp2", "not one of dpN")]:
        with pytest.raises(ConfigError, match=message):
            ParallelDims.parse(bad)


def test_a_cell_gets_its_layout_batch_share_precision_and_layout_independence():
    assert cell_overrides(ParallelDims.parse("tp2-dp2"), "bf16", global_batch=8, overrides=["seed=3"]) == [
        "pp=1", "dp_replicate=2", "dp_shard=1", "tp=2", "ep=1", "micro_batch_size=4", "precision=bf16",
        "dropout=0", "moe_jitter_eps=0", "moe_aux_loss_coeff=0", "seed=3"]
    assert "micro_batch_size=4" not in cell_overrides(ParallelDims.parse("dp2"), "fp32", global_batch=None,
                                                      layout_independent=False)
    with pytest.raises(ConfigError, match="global batch of 6 does not split over 4 data-parallel ranks"):
        cell_overrides(ParallelDims.parse("dp4"), "fp32", global_batch=6)
    with pytest.raises(ConfigError, match="conflicts with --global-batch"):
        matrix_program(overrides=["micro_batch_size=2"], global_batch=8)


def test_a_cell_whose_batch_does_not_split_cannot_start_and_nothing_runs(tmp_path):
    result = M.run_matrix(matrix_program(global_batch=3), tmp_path / "m", cells=["dp2"], precisions=["fp32"],
                          steps=2)
    (cell,) = result.cells
    assert not cell.started and cell.reason.startswith("cannot start: the global batch of 3 does not split"), cell
    assert result.verdict is Verdict.FAIL and not (tmp_path / "m" / "dp2-fp32").exists()


def test_ulp_distance_counts_representable_values():
    one = struct.pack("<f", 1.0)
    next_up = struct.pack("<I", struct.unpack("<I", one)[0] + 3)  # three float32 steps above 1.0
    assert M._max_ulp({"grad_norm": ("float32", one)}, {"grad_norm": ("float32", next_up)}) == 3
    # across zero: -0.0 and +0.0 are the same point; the smallest subnormals either side are 2 apart
    neg_tiny, pos_tiny = struct.pack("<I", 0x80000001), struct.pack("<I", 0x00000001)
    assert distance.ulp_distance("float32", struct.pack("<f", -0.0), struct.pack("<f", 0.0)) == 0
    assert distance.ulp_distance("float32", neg_tiny, pos_tiny) == 2
    assert M._max_ulp({"lr": ("float64", struct.pack("<d", 0.5))}, {"lr": ("float32", one)}) is None


def test_matrix_passes_and_reports_cells_that_cannot_start(tmp_path, capsys):
    # "single" runs and holds; "dp4" needs more ranks than allowed: not required, so the
    # matrix still passes, and says why the cell did not run.
    code = main(["matrix", "--out", str(tmp_path / "m"), "--cells", "single,dp4", "--precisions", "fp32",
                 "--required", "single", "--max-world-size", "2", "--steps", "2",
                 "--global-batch", str(GLOBAL_BATCH), *[part for item in TINY for part in ("--set", item)], "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["verdict"] == "pass", report
    single, dp4 = report["cells"]
    assert (single["cell"], single["precision"], single["verdict"], single["repeatable"], single["resume"]) == \
        ("single", "fp32", "pass", "yes", "yes")
    assert single["agreement"]["status"] == "baseline" and single["seconds"] > 0
    assert dp4["verdict"] == "incomplete" and not dp4["required"]
    assert "needs 4 ranks, more than this matrix allows (2" in dp4["reason"]
    assert json.loads((tmp_path / "m" / "summary.json").read_text())["verdict"] == "pass"
    assert (tmp_path / "m" / "single-fp32" / "summary.json").exists()  # verify's own summary per cell
    # Nothing ran and nothing failed: nothing was proven.
    assert "samebits matrix: INCOMPLETE" in render(M.MatrixResult("o", "single", []))


def test_a_required_cell_that_cannot_start_fails_with_the_reason(tmp_path):
    # The library runs what it is given: a cell that cannot start is a FAIL with its reason
    # (the CLI refuses an unknown precision before any work: tests/test_cli_inputs.py).
    result = M.run_matrix(matrix_program(), tmp_path / "m", cells=["single", "dp16"], precisions=["fp9"],
                          max_world_size=2, steps=2)
    text = render(result)
    assert result.verdict is Verdict.FAIL and result.verdict.exit_code == 1, text
    assert "samebits matrix: FAIL" in text
    assert "single fp9 (required): cannot start: samebits.recipes: error: precision='fp9' is not one of" in text
    assert "dp16 fp9 (required): cannot start: needs 16 ranks" in text


def test_the_cli_refuses_an_unknown_precision_before_any_work(tmp_path, capsys):
    code = main(["matrix", "--out", str(tmp_path / "m"), "--cells", "single", "--precisions", "fp9"])
    assert code == 2 and "fp9" in capsys.readouterr().err and not (tmp_path / "m").exists()


def test_a_micro_batch_override_conflicts_with_the_global_batch(tmp_path, capsys):
    # A --set micro_batch_size would silently win over each cell's share of the global
    # batch, and the cells would train on different batches: refused, with both ways out.
    code = main(["matrix", "--out", str(tmp_path / "m"), "--cells", "single,dp2", "--set", "micro_batch_size=2"])
    error = capsys.readouterr().err
    assert code == 2 and "--set micro_batch_size=2 conflicts with --global-batch 8" in error, error
    assert "--global-batch 0" in error and not (tmp_path / "m").exists()


def test_a_missing_dependency_is_named(tmp_path, monkeypatch):
    # A torchao that cannot be imported, as on a machine without it.
    fake = tmp_path / "site" / "torchao"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named torchao (test stand-in)')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path / "site"),
                                                                   os.environ.get("PYTHONPATH")])))
    result = M.run_matrix(matrix_program(overrides=TINY, global_batch=GLOBAL_BATCH), tmp_path / "m",
                          cells=["single"], precisions=["mxfp8"], steps=2)
    assert result.verdict is Verdict.FAIL
    (cell,) = result.cells
    assert not cell.started and "needs torchao, which is not installed: pip install torchao==" in cell.reason


@pytest.mark.slow
def test_a_nondeterministic_cell_is_caught_even_when_not_required(tmp_path):
    result = M.run_matrix(matrix_program(nondeterministic=True), tmp_path / "m", cells=["single"],
                          precisions=["fp32"], required=[], steps=2)
    (cell,) = result.cells
    assert cell.check("independent") == "no" and cell.verdict is Verdict.FAIL, cell.to_dict()
    assert result.verdict is Verdict.FAIL and result.verdict.exit_code == 1
    assert any("independent diverged" in line for line in result.failures())


def test_bisect_failures_flag_reaches_the_matrix(tmp_path, monkeypatch, capsys):
    """The command line passes --bisect-failures through (the runs are in the test below)."""
    seen = {}

    def fake_run_matrix(matrix, out, **kwargs):
        seen.update(kwargs)
        return M.MatrixResult(str(out), "single", [])

    monkeypatch.setattr("samebits.cli.matrix.run_matrix", fake_run_matrix)
    main(["matrix", "--out", str(tmp_path / "m"), "--cells", "tp2", "--bisect-failures", "--json"])
    assert seen["bisect_failures"] is True
    main(["matrix", "--out", str(tmp_path / "n"), "--cells", "tp2", "--json"])
    assert seen["bisect_failures"] is False
    capsys.readouterr()


def _diverged_verify(program, out, **_kwargs):
    """verify's answer for a cell whose two independent runs differ (no runs made)."""
    check = SimpleNamespace(verdict="diverged", incomplete=[], notes=[], to_dict=lambda: {"verdict": "diverged"})
    return VerifyResult(str(out), {"independent": check, "resume": None}, {}, None)


@pytest.mark.slow
def test_bisect_failures_localises_a_planted_fault(tmp_path, monkeypatch):
    """A tp2 cell whose row-parallel linears sum their chunks in a random order (the planted
    fault ``fault_tp_racy_accumulate``) is bisected, and --bisect-failures names where: step
    0, the forward, the first block's attention output projection, the op that draws the
    order; in the table (the why column, the conclusion under it) and in the JSON
    (``bisect.origin``).  The bisection's runs are real; the cell's verify runs (which catch
    this fault in tests/test_parallel_cells.py) are answered "independent runs diverged" to
    keep the test short."""
    monkeypatch.setattr(M, "verify", _diverged_verify)
    matrix = matrix_program(global_batch=GLOBAL_BATCH, overrides=[*TINY, "fault_tp_racy_accumulate=true"])
    result = M.run_matrix(matrix, tmp_path / "m", cells=["tp2"], precisions=["fp32"], steps=1, bisect_failures=True)
    (cell,) = result.cells
    assert cell.verdict is Verdict.FAIL and cell.check("independent") == "no", cell.to_dict()
    report = json.loads(json.dumps(result.to_dict()))  # what --json prints
    origin = report["cells"][0]["bisect"]["origin"]
    assert origin is not None, report["cells"][0]["bisect"]
    assert (origin["step"], origin["phase"], origin["module"]) == (0, "forward", "layers.0.attn.out"), origin
    assert origin["rank"] in (0, 1) and origin["op"] == "aten::randperm"
    assert json.loads((tmp_path / "m" / "summary.json").read_text())["cells"][0]["bisect"]["origin"] == origin
    assert "tp2 fp32, bisect: the RNG op aten::randperm" in render(result)  # the conclusion under the table
    assert _why_column(render(result)) == \
        "bisect:step0,rank{rank},forward,layers.0.attn.out,aten::randperm".format(**origin)


def _why_column(text: str) -> str:
    """The last column of a one-row matrix table, its wrapped lines joined without spaces
    (a narrow column wraps inside words too)."""
    lines = text.splitlines()
    rule = next(i for i, line in enumerate(lines) if line.startswith("----"))
    why_at = lines[rule].rindex(" -") + 1
    return "".join(line[why_at:].replace(" ", "") for line in lines[rule + 1:lines.index("", rule)])
