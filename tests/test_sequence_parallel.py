"""Tensor parallelism with sequence parallelism (`sequence_parallel`, recipes/parallelize.py).

One torchrun of 2 ranks (this file run as a script is the worker) does everything that needs
processes: the norms' gradient check on a bare model, then the recipe's tp2 cell with SP (the
default) and without it; a single-rank run of the same model runs in a subprocess.  The
cells themselves (tp2, tp2-dp2, tp2-ep2, tp2-pp2, fsdp2-tp2: SP by default) repeat and
resume in tests/test_parallel_cells.py, where the racy TP fault is caught under SP too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import samebits
from samebits.errors import ConfigError
from samebits.recipes import RecipeConfig
from samebits.recipes.parallelize import ParallelDims, ParallelLayout
from samebits.verdicts import Verdict

TINY = ["num_layers=2", "seq_len=32", "micro_batch_size=2"]
STEPS = 2
JOBS = [("sp", []), ("nosp", ["sequence_parallel=false"]),  # all the tp2 cell
        ("sp-mtp0", ["mtp_num_layers=0"])]  # without MTP the head is sequence-parallel too


# --- config and layout (no processes) ----------------------------------------------------


def test_sequence_parallel_needs_a_sequence_the_tp_ranks_divide():
    with pytest.raises(ConfigError, match=r"sequence_parallel with tp=2 .* seq_len=33 must be "
                                          r"divisible by tp.*sequence_parallel=false"):
        RecipeConfig(tp=2, seq_len=33)
    assert RecipeConfig(tp=2, seq_len=33, sequence_parallel=False).seq_len == 33
    assert RecipeConfig(seq_len=33).sequence_parallel  # on by default; tp=1: no constraint
    assert not RecipeConfig(tp=2).with_overrides(["sequence_parallel=false"]).sequence_parallel


def test_checkpoint_layout_says_whether_the_norms_are_sharded_state():
    dims = ParallelDims(tp=2)
    plain = ParallelLayout(0, 2, dims, None)
    assert plain.checkpoint_layout == {"dp": 1, "ep": 1, "tp": 2}
    sequence = ParallelLayout(0, 2, dims, None, sequence_parallel=True)
    assert sequence.checkpoint_layout == {"dp": 1, "ep": 1, "tp": 2, "sequence_parallel": 1}


# --- one 2-rank job ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           __file__, str(out)]  # --standalone: a free port
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    single = [sys.executable, "-m", "samebits.recipes", "--cell", "single", "--steps", str(STEPS),
              "--out", str(out / "single")] + [a for s in TINY for a in ("--set", s)]
    result = subprocess.run(single, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return out


@pytest.mark.slow
def test_norm_grads_are_summed_over_the_tp_ranks(runs):
    """Under SP a norm's weight is a Replicate DTensor, but each TP rank back-propagates
    through its own positions: DTensor leaves the grad Partial, and taken as it is (the
    faulty variant) the two ranks' grads differ; `reduce_gradients` makes them one."""
    ranks = [json.loads((runs / f"grads-{r}.json").read_text()) for r in (0, 1)]
    names = sorted(ranks[0]["before"])
    # The main blocks' norms (the MTP block runs without SP: its norms stay plain tensors).
    assert names == [f"layers.{i}.{n}_norm.weight" for i in (0, 1) for n in ("attn", "ffn")]
    for name in names:
        before = [r["before"][name] for r in ranks]
        after = [r["after"][name] for r in ranks]
        assert {b["placements"] for b in before} == {"(Partial(sum),)"}
        assert before[0]["sum"] != before[1]["sum"], name  # partial: the ranks differ
        assert {a["placements"] for a in after} == {"(Replicate(),)"}
        assert after[0]["bits"] == after[1]["bits"], name  # one grad, bit for bit on both ranks
        assert after[0]["sum"] == pytest.approx(before[0]["sum"] + before[1]["sum"], rel=1e-5)


def _records(run_dir: Path, rank: int, step: int, phase: str) -> dict:
    run = samebits.open_run(run_dir)
    try:
        block = next(b for b in run.stream(rank).steps() if b.step == step)
        return {r.name: r for r in block.records() if r.phase == phase}
    finally:
        run.close()


@pytest.mark.slow
def test_the_stream_says_which_ran_and_holds_sequence_shards(runs):
    for label, expected, seq_len in (("sp", True, 16), ("nosp", False, 32)):
        run = samebits.open_run(runs / label)
        assert run.header.config["sequence_parallel"] is expected
        run.close()
        forward = _records(runs / label, 0, 0, "forward")
        # The first block's output: this rank's positions under SP, the whole sequence without.
        assert tuple(forward["layers.0"].shape) == (2, seq_len, 64)


@pytest.mark.slow
def test_sequence_parallel_changes_where_not_what_at_the_first_step(runs):
    """Same dropout masks (the whole stream's, sliced), per-row norms, and a two-rank sum
    reduce-scattered instead of all-reduced: step 0's losses are bitwise TP's without SP."""
    for rank in (0, 1):
        sp, nosp = _records(runs / "sp", rank, 0, "metrics"), _records(runs / "nosp", rank, 0, "metrics")
        assert {n: sp[n].raw for n in ("loss", "lm_loss", "mtp_loss")} == \
            {n: nosp[n].raw for n in ("loss", "lm_loss", "mtp_loss")}


@pytest.mark.slow
def test_global_digests_compare_tp2_with_sp_against_one_rank(runs):
    """`diff --by global` matches the tp2+SP run's parameters (TP shards, Replicate norms,
    replicated rest) to the single run's by full tensor: every parameter is compared, the
    SP run's ranks agree on every global digest (a drifted replica would be named in the
    notes), and the first differing step and tensor are reported."""
    same = samebits.diff(runs / "sp", runs / "sp", by="global")
    assert same.verdict is Verdict.IDENTICAL and same.compared["tensors"] == 25, same.to_dict()
    result = samebits.diff(runs / "sp", runs / "single", by="global")
    report = result.to_dict()
    assert report["compared"]["tensors"] == 25 and report["compared"]["steps"] == STEPS
    assert not [n for n in report["notes"] if "diverged within" in n], report["notes"]
    # TP sums a row-parallel product in two halves: another rounding than one rank's.
    assert result.verdict is Verdict.DIVERGED, report
    first = report["first_divergence"]
    assert (first["step"], first["phase"]) == (0, "params") and first["name"] in first["tensors"]
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert set(statuses.values()) <= {"identical", "differs"} and "differs" in statuses.values()


@pytest.mark.slow
def test_without_mtp_the_head_is_sequence_parallel(runs):
    """The output layer is column-parallel over the vocabulary (each TP rank holds half of
    it) and the final norm runs on the shard; the ranks agree on every global digest."""
    params = _records(runs / "sp-mtp0", 0, 0, "params")
    assert tuple(params["output.weight"].shape) == (256, 64) and "mtp.0.proj.weight" not in params
    result = samebits.diff(runs / "sp-mtp0", runs / "sp-mtp0", by="global")
    assert result.verdict is Verdict.IDENTICAL and result.compared["tensors"] == 16, result.to_dict()


# --- the worker -------------------------------------------------------------------------------


def _norm_grads(out_dir: Path) -> None:
    """Forward and backward of a bare tp2+SP model; the norms' grads before and after
    `communication.reduce_gradients`, as this rank sees them."""
    import torch
    from torch.distributed.tensor import DTensor

    from samebits.recipes import communication, parallelize
    from samebits.recipes.model import Transformer

    cfg = RecipeConfig(tp=2, dp_replicate=1, ep=1, num_layers=2, seq_len=32, micro_batch_size=2)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    rank = torch.distributed.get_rank()
    layout = parallelize.parallelize(model, cfg, rank, 2)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    out = model(tokens)
    (out.logits.square().mean() + out.mtp_logits[0].square().mean()).backward()

    def state():
        result = {}
        for name, param in model.named_parameters():
            if isinstance(param.grad, DTensor) and name.endswith("_norm.weight"):
                grad = param.grad.to_local()
                result[name] = {"placements": str(tuple(param.grad.placements)),
                                "sum": float(grad.double().sum()),
                                "bits": grad.view(torch.int32).tolist()}
        return result

    before = state()
    communication.reduce_gradients(model, layout)
    (out_dir / f"grads-{rank}.json").write_text(json.dumps({"before": before, "after": state()}))


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    from samebits.recipes.cli import main

    dist.init_process_group("gloo")
    _norm_grads(out_dir)
    for label, overrides in JOBS:
        argv = ["--cell", "tp2", "--steps", str(STEPS), "--out", str(out_dir / label)]
        for assignment in [*TINY, *overrides]:
            argv += ["--set", assignment]
        if main(argv) != 0:
            raise SystemExit(f"{label}: failed")
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip gloo's C++ static destructors (they abort now and then at exit)
