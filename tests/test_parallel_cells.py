"""The reference recipe on PyTorch's parallel engines: every cell that fits in 4 CPU ranks runs
and repeats bit for bit, and each engine's planted fault is caught and localised.

Runs are grouped to stay inside the test-time budget: one torchrun per world size runs all
of its cells twice (2 steps each, the tiny model) through the recipe's command line, in one
process per rank; the test process then compares the recorded streams with `samebits.diff`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import samebits
from samebits.errors import ConfigError
from samebits.recipes import RecipeConfig
from samebits.recipes.cells import AXES, ParallelDims, cell_name, mesh_axes, parse_cell
from samebits.recipes.parallelize import stage_layers
from samebits.verdicts import Verdict

TINY = ["num_layers=2", "seq_len=32", "micro_batch_size=2"]
STEPS = 2
CELLS_2 = ["dp2", "fsdp2", "tp2", "pp2", "ep2"]
CELLS_4 = ["tp2-dp2", "tp2-ep2", "tp2-pp2", "fsdp2-tp2", "pp2-dp2", "dp4", "fsdp4"]
PP_FAULT = ["micro_batch_size=4", "pp_microbatches=4"]
RESUMED_2 = ["tp2", "fsdp2", "pp2", "ep2"]  # one per engine; 2-D: fsdp2-tp2
RESUMED_4 = ["fsdp2-tp2"]
# A low-precision linear under TP runs its GEMM on local shards (recipes/precision.py
# `_linear`), not through DTensor's ops; fp8_delayed needs only torch.
TP_FP8 = ["precision=fp8_delayed"]
FAULT_JOBS = [  # (label, cell, overrides)
    ("tp_racy-a", "tp2", ["fault_tp_racy_accumulate=true"]),
    ("tp_racy-b", "tp2", ["fault_tp_racy_accumulate=true"]),
    ("ep_order-a", "ep2", ["fault_ep_dispatch_order=true"]),
    ("ep_order-b", "ep2", ["fault_ep_dispatch_order=true"]),
    ("pp_clean", "pp2", PP_FAULT),
    ("pp_reorder-a", "pp2", [*PP_FAULT, "fault_pp_reorder_microbatch_grads=true"]),
    ("pp_reorder-b", "pp2", [*PP_FAULT, "fault_pp_reorder_microbatch_grads=true"]),
]


# --- cells and sizes (no processes) --------------------------------------------------------


@pytest.mark.parametrize("name, sizes", [
    ("dp2", {"dp_replicate": 2, "ep": 1}),
    ("fsdp2", {"dp_shard": 2}),
    ("ep2", {"dp_replicate": 2, "ep": 2}),
    ("tp2-ep2", {"tp": 2, "dp_replicate": 2, "ep": 2}),
    ("fsdp2-tp2", {"dp_shard": 2, "tp": 2}),
    ("PP2-dp2", {"pp": 2, "dp_replicate": 2}),
])
def test_parse_cell_fixes_the_whole_layout(name, sizes):
    overrides = parse_cell(name)
    assert overrides == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1, "ep": 1, **sizes}
    dims = ParallelDims.resolve(RecipeConfig(**overrides), ParallelDims(**overrides).world_size)
    assert parse_cell(cell_name(dims)) == overrides  # the canonical name round-trips


def test_the_cell_grammar_reads_every_axis_of_the_one_table():
    """`AXES` is the one list of axes: `ParallelDims` has one size per axis, the mesh
    positions and name places are distinct, and the grammar parses and prints each axis's
    word (an axis run over another's ranks sets that one's size too)."""
    assert {f.name for f in dataclasses.fields(ParallelDims)} == {axis.field for axis in AXES}
    assert [axis.mesh for axis in mesh_axes()] == list(range(len(mesh_axes())))
    assert sorted(axis.name_order for axis in AXES) == list(range(len(AXES)))
    for axis in AXES:
        sizes = parse_cell(f"{axis.word}2")
        split = {axis.field: 2, **({axis.over: 2} if axis.over else {})}
        assert sizes == {field: split.get(field, 1) for field in sizes}, axis
        dims = ParallelDims(**sizes)
        assert cell_name(dims) == f"{axis.word}2" and dims.world_size == 2
        assert set(dims.coordinates(1)) == {a.coordinate for a in AXES} and dims.coordinates(1)[axis.coordinate] == 1
    every = "-".join(f"{axis.word}2" for axis in AXES if axis.over is None)
    assert ParallelDims.parse(every).mesh_shape() == (2,) * len(mesh_axes())
    assert ParallelDims.parse("pp2-dp2-tp2").coordinates(5) == {"pp": 1, "dp": 0, "tp": 1, "ep": 0}
    assert ParallelDims.parse("fsdp2-tp2").coordinates(3) == {"pp": 0, "dp": 1, "tp": 1, "ep": 0}


@pytest.mark.parametrize("name, message", [
    ("tp2-tp2", "each at most once"), ("cp2", "not one of dpN"), ("", "names no parallel size"),
    ("dp4-ep2", "must equal dp's size"), ("tp0", "not one of dpN"),
])
def test_parse_cell_refuses_bad_names(name, message):
    with pytest.raises(ConfigError, match=message):
        parse_cell(name)


def test_layout_must_fit_the_world_and_the_model():
    assert ParallelDims.resolve(RecipeConfig(), 4) == ParallelDims(dp_replicate=4, ep=4)  # default
    assert ParallelDims.resolve(RecipeConfig(tp=2), 4) == ParallelDims(dp_replicate=2, tp=2, ep=2)
    with pytest.raises(ConfigError, match=r"tp2-dp2 .* = 4 ranks\) does not fit world size 2"):
        ParallelDims.resolve(RecipeConfig(**parse_cell("tp2-dp2")), 2)
    with pytest.raises(ConfigError, match="HSDP"):
        ParallelDims.resolve(RecipeConfig(dp_replicate=2, dp_shard=2, ep=1), 4)
    with pytest.raises(ConfigError, match="tp=3 must divide num_heads=4"):
        RecipeConfig(tp=3)
    with pytest.raises(ConfigError, match="pp_microbatches=3 must divide micro_batch_size=4"):
        RecipeConfig(pp=2, pp_microbatches=3)
    with pytest.raises(ConfigError, match="fault_tp_racy_accumulate .* set tp >= 2"):
        RecipeConfig(fault_tp_racy_accumulate=True)
    with pytest.raises(ConfigError, match="fault_ep_dispatch_order .* needs ep >= 2"):
        ParallelDims.resolve(RecipeConfig(fault_ep_dispatch_order=True, **parse_cell("dp2")), 2)
    assert [stage_layers(5, 2, s) for s in (0, 1)] == [[0, 1, 2], [3, 4]]


def test_command_line_refuses_a_bad_cell_with_exit_2(capsys):
    from samebits.recipes.cli import main

    assert main(["--cell", "tp3-dp2", "--steps", "1"]) == 2
    assert "tp=3 must divide num_heads=4" in capsys.readouterr().err
    assert main(["--cell", "tp2", "--steps", "1"]) == 2  # one process, a 2-rank cell
    assert "does not fit world size 1; launch 2 ranks" in capsys.readouterr().err


# --- the cells, run --------------------------------------------------------------------------


def _resume_jobs(cells: list[str], overrides: list[str] = (), suffix: str = "") -> list:
    """Per cell: save before step 1 and exit, then resume into the same stream."""
    overrides = list(overrides)
    return [job for cell in cells for job in (
        (f"{cell}{suffix}-resumed", cell, overrides, ["--save-at", "1", "--ckpt", f"ckpt-{cell}{suffix}"]),
        (f"{cell}{suffix}-resumed", cell, overrides, ["--resume-from", f"ckpt-{cell}{suffix}"]))]


def _launch(tmp_path: Path, world_size: int, jobs: list) -> Path:
    """One torchrun of `world_size` ranks running `jobs` (label, cell, overrides[, more
    arguments]) in order."""
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size), __file__,
           str(tmp_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return tmp_path


@pytest.fixture(scope="module")
def runs_2(tmp_path_factory):
    jobs = [(f"{cell}-{run}", cell, []) for cell in CELLS_2 for run in "ab"] + FAULT_JOBS \
        + _resume_jobs(RESUMED_2) + [("tp2-fp8-a", "tp2", TP_FP8)] + _resume_jobs(["tp2"], TP_FP8, "-fp8")
    return _launch(tmp_path_factory.mktemp("cells2"), 2, jobs)


@pytest.fixture(scope="module")
def runs_4(tmp_path_factory):
    jobs = [(f"{cell}-{run}", cell, []) for cell in CELLS_4 for run in "ab"] \
        + _resume_jobs(RESUMED_4)
    return _launch(tmp_path_factory.mktemp("cells4"), 4, jobs)


def _identical(a: Path, b: Path, **kwargs) -> None:
    result = samebits.diff(a, b, **kwargs)
    assert result.verdict is Verdict.IDENTICAL, result.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS_2)
def test_two_rank_cell_runs_and_repeats(runs_2, cell):
    _identical(runs_2 / f"{cell}-a", runs_2 / f"{cell}-b")
    # and by global digests: every rank of a shard group records the same full-tensor digest
    # (expert shards were digested shard by shard when the recipe passed detached tensors)
    _identical(runs_2 / f"{cell}-a", runs_2 / f"{cell}-b", by="global")
    run = samebits.open_run(runs_2 / f"{cell}-a")
    assert run.header.config["parallel"] == {"cell": cell, "mesh": parse_cell(cell)}
    assert {h.coords["tp"] for h in run.headers.values()} == set(range(parse_cell(cell)["tp"]))


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS_4)
def test_four_rank_cell_runs_and_repeats(runs_4, cell):
    _identical(runs_4 / f"{cell}-a", runs_4 / f"{cell}-b")
    _identical(runs_4 / f"{cell}-a", runs_4 / f"{cell}-b", by="global")


@pytest.mark.slow
@pytest.mark.parametrize("cell", RESUMED_2)
def test_cell_resumes_bit_for_bit(runs_2, cell):
    """Saved before step 1 and resumed (DTensor shards saved rank-locally; the pipeline's
    shape inference leaves no trace): the stream equals the straight run's."""
    _identical(runs_2 / f"{cell}-a", runs_2 / f"{cell}-resumed")


@pytest.mark.slow
@pytest.mark.parametrize("cell", RESUMED_4)
def test_four_rank_cell_resumes_bit_for_bit(runs_4, cell):
    """As above, for the 2-D cells (apart, so that the 2- and 4-rank runs need not share a
    pytest-xdist worker)."""
    _identical(runs_4 / f"{cell}-a", runs_4 / f"{cell}-resumed")


@pytest.mark.slow
def test_tensor_parallel_low_precision_resumes_bit_for_bit(runs_2):
    """A converted linear under TP (fp8 delayed scaling) resumes exactly.  It used to diverge
    at the resume step's first forward: its column-parallel input gradient skipped the TP
    all-reduce, the replicated parameters drifted apart across the TP ranks, and the
    checkpoint (replicated state saved once, from rank 0) put rank 0's copy on both."""
    _identical(runs_2 / "tp2-fp8-a", runs_2 / "tp2-fp8-resumed")


def _replicated_params_by_rank(run_dir: Path) -> dict[int, dict[tuple[int, str], str]]:
    """Per rank: (step, name) -> digest of the recorded parameters a TP rank holds whole."""
    run = samebits.open_run(run_dir)
    try:
        return {rank: {(block.step, r.name): r.digest for block in run.stream(rank).steps()
                       for r in block.records() if r.phase == "params"
                       and not r.name.endswith(("qkv.weight", "attn.out.weight", "ffn.up.weight",
                                                "ffn.down.weight"))}
                for rank in run.ranks}
    finally:
        run.close()


@pytest.mark.slow
@pytest.mark.parametrize("label", ["tp2-a", "tp2-fp8-a"])
def test_replicated_parameters_stay_equal_on_the_tp_ranks(runs_2, label):
    """The norms (Replicate DTensors under sequence parallelism, whose Partial grads the
    recipe sums over the TP ranks), the embedding, the router, the experts and the output
    layer are replicated on the TP ranks: after every step, bit for bit (the root invariant
    behind the resume test above)."""
    by_rank = _replicated_params_by_rank(runs_2 / label)
    assert by_rank[0] and by_rank[0].keys() == by_rank[1].keys()
    differing = sorted(key for key in by_rank[0] if by_rank[0][key] != by_rank[1][key])
    assert differing == [], f"replicated parameters differ across the TP ranks: {differing[:5]}"


def _first(result) -> samebits.compare.Divergence:
    assert result.verdict is Verdict.DIVERGED, result.to_dict()
    return result.first_divergence


@pytest.mark.slow
def test_racy_tensor_parallel_accumulate_is_caught_in_the_tp_layer(runs_2):
    run = samebits.open_run(runs_2 / "tp_racy-a")
    assert run.header.config["sequence_parallel"] is True  # TP with SP, the default
    run.close()
    result = samebits.diff(runs_2 / "tp_racy-a", runs_2 / "tp_racy-b")
    first = _first(result)
    # The first record to differ: the first block's output (its row-parallel attention
    # output projection sums in a racing order before the reduce-scatter), on both TP
    # ranks, at step 0.
    assert (first.step, first.phase, first.name) == (0, "forward", "layers.0")
    assert sorted(result.ranks_diverged_first) == [0, 1]


@pytest.mark.slow
def test_expert_dispatch_order_is_caught_in_the_expert_grads(runs_2):
    result = samebits.diff(runs_2 / "ep_order-a", runs_2 / "ep_order-b")
    first = _first(result)
    # Forward outputs are row-wise and do not change; the expert weight grads sum their
    # rows in the dispatcher's order.
    assert (first.step, first.phase) == (0, "grads")
    assert ".experts.w" in first.name


@pytest.mark.slow
def test_pipeline_microbatch_reorder_is_caught_on_the_last_stage(runs_2):
    _identical(runs_2 / "pp_reorder-a", runs_2 / "pp_reorder-b")  # a fixed (wrong) order repeats
    result = samebits.diff(runs_2 / "pp_clean", runs_2 / "pp_reorder-a", allow_config_diff=True)
    first = _first(result)
    assert first.step == 0
    # The recipe records its metrics before the gradients (recorded after the update): the
    # grad norm, all-reduced over the stages, is the first record to differ, on every stage.
    assert (first.phase, first.name) in (("metrics", "grad_norm"), ("grads", first.name))
    # The gradients differ on the last stage, where the order changed, and on the first stage
    # only in the embedding it shares with the last (the tied weights' gradients are summed).
    differing = {rank: _first_grad_difference(runs_2 / "pp_clean", runs_2 / "pp_reorder-a", rank) for rank in (0, 1)}
    assert differing[0] in (None, "embed.weight"), differing
    assert differing[1] is not None and differing[1].startswith(("layers.1.", "norm.", "output.", "mtp."))


def _first_grad_difference(run_a: Path, run_b: Path, rank: int) -> str | None:
    """The first gradient record of step 0 on ``rank`` whose digest differs, or None."""
    steps = [next(iter(samebits.open_run(run).stream(rank).steps())) for run in (run_a, run_b)]
    grads_a, grads_b = ({r.name: r for r in block.records() if r.phase == "grads"} for block in steps)
    assert grads_a and grads_a.keys() == grads_b.keys()
    return next((name for name, record in grads_a.items() if not record.same_content(grads_b[name])), None)


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    from samebits.recipes.cli import main

    dist.init_process_group("gloo")
    for label, cell, overrides, *more in json.loads((out_dir / "jobs.json").read_text()):
        more = [str(out_dir / a) if a.startswith("ckpt-") else a for a in (more[0] if more else [])]
        argv = ["--cell", cell, "--steps", str(STEPS), "--out", str(out_dir / label), *more]
        for assignment in [*TINY, *overrides]:
            argv += ["--set", assignment]
        code = main(argv)
        if code != 0:
            raise SystemExit(f"{label}: exit {code}")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    # Everything is written. Skip the C++ static destructors: under load a gloo process
    # occasionally aborts there (SIGABRT, "terminate called without an active exception").
    # (Inside this block: at module level it would end pytest itself when it imports this file.)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
