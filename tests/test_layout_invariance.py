"""The same bits at tp=1 and tp=2 (issue 28): `samebits.invariant`'s TP layers split over real
ranks, and the recipe with `tp_reduce=invariant` (docs/invariance.md); then tp x dp (both
switches) and FSDP2 (`grad_reduce=invariant`: `InvariantReduceScatter`) against one rank.

This file run as a script is the worker: under torchrun at world 2 and 4 it runs the column-
and row-parallel layers (forward and backward) and the sharded norm on shares of the same
tensors (fast); at world 2 (slow) the recipe's tp2 cell with the switch (20 steps, with
sequence parallelism and without) and without it (the control, 1 step), and in one plain
process the same runs on one rank.  The mixed layouts (slow): tp2-dp2 and fsdp2-tp2 at world
4, fsdp2, pp2 and ep2 at world 2, with the switches and without (the controls), and one rank
with them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import samebits
from samebits.errors import ConfigError
from samebits.invariant import (InvariantReduceScatter, block_exponents, column_parallel_linear, decode, encode,
                                fraction_bits, invariant_matmul, invariant_sum, row_parallel_linear, scale_columns,
                                sharded_grad_norm)
from samebits.invariant import tree_matmul
from samebits.recipes import RecipeConfig
from samebits.recipes.cells import ParallelDims
from samebits.runners.across import compare_replicated
from samebits.verdicts import Verdict

TINY = ["num_layers=2", "seq_len=32", "micro_batch_size=2"]
STEPS = 20
# (label, overrides, steps, cells): with sequence parallelism (the default at tp2) and without
JOBS = [("invariant", ["tp_reduce=invariant"], STEPS, ("single", "tp2")),
        ("invariant-nosp", ["tp_reduce=invariant", "sequence_parallel=false"], STEPS, ("tp2",)),
        ("plain", [], 1, ("single", "tp2"))]
TOKENS, K_ROW, N_ROW, K_COL, N_COL = (2, 7), 256, 96, 64, 256  # every share whole blocks of 32 up to tp=4
MIXED_STEPS = 5
GRAD, BOTH = ["grad_reduce=invariant", "ep=1"], ["grad_reduce=invariant", "tp_reduce=invariant", "ep=1"]
# (label, overrides, steps, cell): tp x dp and FSDP2 against one rank; the controls lack a switch
MIXED_JOBS = [("grad", GRAD, MIXED_STEPS, "single"), ("both", BOTH, MIXED_STEPS, "single"),
              ("grad", GRAD, MIXED_STEPS, "fsdp2"), ("both", BOTH, MIXED_STEPS, "fsdp2"),
              ("plain", ["grad_reduce=mean", "ep=1"], 1, "fsdp2"),
              ("both", BOTH, MIXED_STEPS, "tp2-dp2"),
              ("plain-dp", ["grad_reduce=mean", "tp_reduce=invariant", "ep=1"], 1, "tp2-dp2"),
              ("grad", GRAD, MIXED_STEPS, "pp2"), ("plain", ["grad_reduce=mean", "ep=1"], 1, "pp2"),
              ("both", BOTH, MIXED_STEPS, "fsdp2-tp2"),
              ("grad", ["grad_reduce=invariant"], MIXED_STEPS, "ep2"), ("plain", ["grad_reduce=mean"], 1, "ep2")]
FSDP_BUFFER = 96  # a flat reduce-scatter buffer: whole shards at 1, 2 and 4 ranks


# --- config (no processes) ------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"tp": 2, "sequence_parallel": False, "precision": "bf16"}, "does not cover precision='bf16' yet"),
    ({"tp": 2, "sequence_parallel": False, "ep": 0}, "does not cover ep=0 yet"),
    ({"tp": 2, "sequence_parallel": False, "pp": 2}, "does not cover pp=2 yet"),
    ({"tp": 2, "dp_shard": 2}, "does not cover dp_shard=2 yet"),
    ({"tp": 2, "sequence_parallel": False, "fault_tp_racy_accumulate": True}, "does not cover fault_tp_racy_accumulate=True yet"),
    ({"tp": 2, "sequence_parallel": False, "d_model": 96, "num_heads": 2},
     r"at tp=2, d_model=96 and ffn_hidden_size=256 must be multiples of 64"),
    ({"tp": 4, "sequence_parallel": False}, r"at tp=4, d_model=64 .* multiples of 128; change the sizes"),
])
def test_tp_reduce_invariant_refuses_what_it_does_not_cover(overrides, message):
    with pytest.raises(ConfigError, match=message):
        RecipeConfig(tp_reduce="invariant", **{"ep": 1, **overrides})


@pytest.mark.parametrize("overrides, message", [
    ({"tp": 2, "sequence_parallel": False}, r"grad_reduce='invariant' with tp=2 needs tp_reduce='invariant' too"),
    ({"ep": 0, "tp": 2, "tp_reduce": "invariant", "sequence_parallel": False},
     r"with ep=0 covers tp=1 and moe_grouped_gemm='torch' only"),
    ({"pp": 2, "tp": 2, "tp_reduce": "invariant", "sequence_parallel": False}, r"with pp=2 covers tp=1 only"),
])
def test_grad_reduce_invariant_refuses_the_layouts_it_does_not_cover(overrides, message):
    with pytest.raises(ConfigError, match=message):
        RecipeConfig(grad_reduce="invariant", **{"ep": 1, **overrides})


def test_grad_reduce_invariant_takes_tp_with_tp_reduce_invariant_fsdp2_pp_and_ep():
    for cell, extra in (("tp2-dp2", ["tp_reduce=invariant"]), ("tp2", ["tp_reduce=invariant"]),
                        ("fsdp2", []), ("fsdp2", ["tp_reduce=invariant"]), ("fsdp2-tp2", ["tp_reduce=invariant"]),
                        ("pp2", []), ("pp2-dp2", []), ("ep2", []), ("ep4", ["tp_reduce=invariant"]),
                        ("pp2", ["tp_reduce=invariant"])):
        sizes = ParallelDims.parse(cell).overrides()
        cfg = RecipeConfig().with_overrides([*sizes, "grad_reduce=invariant", *extra])
        assert cfg.grad_reduce == "invariant", cell


def test_the_fsdp2_reduce_scatter_refuses_an_average_and_low_precision():
    comm = InvariantReduceScatter(num_micro_batches=4)
    out, buffer = torch.empty(8), torch.zeros(8)
    with pytest.raises(ConfigError, match=r"set_gradient_divide_factor\(1.0\)"):
        comm(out, buffer, None, torch.distributed.ReduceOp.AVG)
    with pytest.raises(ConfigError, match="takes fp32 gradients, got torch.bfloat16"):
        comm(out, buffer.bfloat16(), None, None)


def test_tp_reduce_invariant_runs_at_tp_1_and_tp_2_with_or_without_sequence_parallelism():
    assert RecipeConfig(tp_reduce="invariant", ep=1).tp_reduce == "invariant"
    for sequence_parallel in ("true", "false"):
        cfg = RecipeConfig(ep=1, tp=2).with_overrides(["tp_reduce=invariant", f"sequence_parallel={sequence_parallel}"])
        assert cfg.tp_reduce == "invariant"
    with pytest.raises(ConfigError, match="tp_reduce='fast' is not one of plain, invariant"):
        RecipeConfig(tp_reduce="fast")


def test_the_switch_puts_the_invariant_layers_in_the_model_on_one_rank_too():
    """At tp=1 the recipe's TP linears and the blocks' norms are the invariant ones (the same
    layer math as at every TP degree); without the switch they are torch's."""
    from samebits.recipes import parallelize
    from samebits.recipes.model import Transformer

    def build(tp_reduce):
        cfg = RecipeConfig(ep=1, num_layers=2, tp_reduce=tp_reduce)
        model = Transformer(cfg)
        model.init_weights(torch.Generator().manual_seed(0))
        parallelize.parallelize(model, cfg, 0, 1)
        return model

    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(1))
    for tp_reduce in ("invariant", "plain"):
        block = build(tp_reduce).layers["0"]
        weight = block.attn.out.weight.detach()
        out = block.attn.out(x)
        if tp_reduce == "invariant":
            assert torch.equal(out, tree_matmul(x, weight.t()))  # the row layer's forward: a split K
        else:
            assert torch.equal(out, torch.nn.functional.linear(x, weight))
        norm = block.attn_norm
        norm(x).square().sum().backward()
        rows = torch.nn.functional.rms_norm(x, norm.normalized_shape, None, norm.eps)
        summed = invariant_sum(2 * rows * norm.weight.detach() * rows)  # d(sum y^2)/dw, summed exactly
        assert torch.equal(norm.weight.grad, summed) == (tp_reduce == "invariant")


# --- the runs -----------------------------------------------------------------------------------


def _launch(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def _torchrun(world_size: int, out: Path, mode: str) -> None:
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             str(world_size), __file__, str(out), mode])


@pytest.fixture(scope="module")
def layer_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("layers")
    for world_size in (2, 4):
        _torchrun(world_size, out, "layers")
    return out


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory) -> Path:
    """The recipe at tp2 and on one rank, with and without the switch (about 20 s idle)."""
    out = tmp_path_factory.mktemp("recipe")
    _torchrun(2, out, "recipe")
    _launch([sys.executable, __file__, str(out), "single"])
    return out


def _reference() -> dict[str, torch.Tensor]:
    """The layers and the norm on one rank (group None): what every split must reproduce."""
    return _layer_results(None, 0, 1)


def test_tp_layers_forward_and_backward_have_the_same_bits_at_tp_1_2_and_4(layer_runs):
    """Row-parallel (K split: the forward sums over the ranks) and column-parallel (N split:
    the input gradient sums over the ranks): outputs, input and weight gradients, joined
    from the shares, equal the one-rank layer's bit for bit, on every rank; so do the
    gradient norm, a norm weight's gradient summed over positions split over the ranks, and
    the norm of tensors each held whole by one rank (pipeline stages)."""
    ref = _reference()
    for world_size in (2, 4):
        ranks = [torch.load(layer_runs / f"layers-{world_size}-{r}.pt") for r in range(world_size)]
        for name in ("row_y", "col_grad_x", "norm", "sp_norm_grad_w", "pp_norm"):  # whole on every rank
            for rank, got in enumerate(ranks):
                assert torch.equal(got[name], ref[name]), (world_size, rank, name)
        for name, dim in (("row_grad_x", -1), ("row_grad_w", 1), ("col_y", -1), ("col_grad_w", 0)):
            joined = torch.cat([got[name] for got in ranks], dim=dim)
            assert torch.equal(joined, ref[name]), (world_size, name)
        # the controls: the same shares summed as plain TP does (fp32 partials, all-reduced),
        # on a K where that differs from the one-rank GEMM on this CPU, checked before use (a
        # GEMM that blocks K the way the shares do gives the plain sum's bits: 256 over 2 ranks
        # on AMD EPYC), and the invariant layer on those same inputs equals one rank;
        # stage tensors without replicated=False (a whole one on rank 1 counted as a replica)
        control_k = ranks[0]["control_k"]
        assert control_k is not None, f"no control K where plain TP differs from one rank at tp={world_size}"
        x_ctrl, w_ctrl = _control_inputs(control_k)
        assert not torch.equal(ranks[0]["plain_row_y"], x_ctrl @ w_ctrl.t()), world_size
        for rank, got in enumerate(ranks):
            assert torch.equal(got["control_row_y"], row_parallel_linear(x_ctrl, w_ctrl, None).detach()), \
                (world_size, rank, control_k)
        assert not torch.equal(ranks[0]["pp_norm_unflagged"], ref["pp_norm"]), world_size
        assert "split over %d ranks into 48 elements each" % world_size in ranks[0]["uneven"]


def test_fsdp2_reduce_scatter_shards_join_into_the_one_rank_sum_and_blocks_across_the_cut_do_not(layer_runs):
    """`InvariantReduceScatter` on a flat buffer (values spanning 60 binary orders, as FSDP2's
    buffer of many parameters does) with 4 micro-batches shared by 1, 2 or 4 ranks: the joined
    shards equal the one-rank sum bit for bit.  The control: the same sum in blocks of 16
    elements, each rank blocking its own shard (the cut inside a block at 4 ranks), differs."""
    ref = _reference()
    for world_size in (2, 4):
        ranks = [torch.load(layer_runs / f"layers-{world_size}-{r}.pt") for r in range(world_size)]
        assert torch.equal(torch.cat([got["fsdp_shard"] for got in ranks]), ref["fsdp_shard"]), world_size
        assert all(got["fsdp_stats"] == ref["fsdp_stats"] for got in ranks)
    shards = [torch.load(layer_runs / f"layers-4-{r}.pt")["blocked_shard"] for r in range(4)]
    assert ref["fsdp_stats"] == 0  # each element its own block: every encoding exact, the sum correctly rounded
    assert not torch.equal(torch.cat(shards), ref["blocked_shard"])


@pytest.mark.slow
@pytest.mark.parametrize("label", ["invariant", "invariant-nosp"])
def test_the_recipe_at_tp2_is_bit_identical_to_one_rank_with_tp_reduce_invariant(recipe_runs, label):
    """Every step's parameters, by global digest (TP shards joined), and rank 0's replicated
    records (losses, grad norm; block outputs without SP, where they are whole), for 20 steps
    of the MoE + MTP model, with sequence parallelism and without."""
    runs = recipe_runs
    result = samebits.diff(runs / "single-invariant", runs / f"tp2-{label}", by="global")
    report = result.to_dict()
    assert result.verdict is Verdict.IDENTICAL, report
    assert report["compared"]["steps"] == STEPS and report["compared"]["tensors"] == 25, report["compared"]
    phases = ["metrics"] if label == "invariant" else ["metrics", "forward"]
    replicated = compare_replicated(runs / "single-invariant", runs / f"tp2-{label}", phases=phases)
    assert replicated.verdict is Verdict.IDENTICAL and replicated.compared["steps"] == STEPS, replicated.to_dict()


@pytest.mark.slow
def test_control_without_the_switch_tp2_differs_from_one_rank_at_the_first_step(recipe_runs):
    result = samebits.diff(recipe_runs / "single-plain", recipe_runs / "tp2-plain", by="global")
    report = result.to_dict()
    assert result.verdict is Verdict.DIVERGED, report
    assert report["first_divergence"]["step"] == 0 and report["first_divergence"]["phase"] == "params"


@pytest.fixture(scope="module")
def mixed_runs(tmp_path_factory) -> Path:
    """One rank, fsdp2, pp2 and ep2 (world 2), tp2-dp2 and fsdp2-tp2 (world 4), with the
    switches and without (`MIXED_JOBS`; about 2 minutes on 2 busy cores)."""
    out = tmp_path_factory.mktemp("mixed")
    _launch([sys.executable, __file__, str(out), "mixed-single"])
    _torchrun(2, out, "mixed-fsdp2")
    _torchrun(4, out, "mixed-tp2-dp2")
    _torchrun(2, out, "mixed-pp2")
    _torchrun(4, out, "mixed-fsdp2-tp2")
    _torchrun(2, out, "mixed-ep2")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("run, reference, steps", [("tp2-dp2-both", "single-both", MIXED_STEPS),
                                                   ("fsdp2-grad", "single-grad", MIXED_STEPS),
                                                   ("fsdp2-both", "single-both", MIXED_STEPS),
                                                   ("pp2-grad", "single-grad", MIXED_STEPS),
                                                   ("fsdp2-tp2-both", "single-both", MIXED_STEPS),
                                                   ("ep2-grad", "single-grad", MIXED_STEPS)])
def test_tp_x_dp_fsdp2_and_pp2_are_bit_identical_to_one_rank(mixed_runs, run, reference, steps):
    """tp2-dp2 with grad_reduce and tp_reduce invariant, fsdp2 with grad_reduce invariant (and
    with both), pp2 (1F1B) with grad_reduce invariant, fsdp2-tp2 with both (the clipping norm
    over FSDP2 and TP shards; step 2 clips), ep2 with grad_reduce invariant (experts sharded
    over the DP ranks; one rank replicates them): every step's parameters by global digest,
    and rank 0's losses and grad norm (rank 0 of pp2 is the first stage: the losses it holds
    are the last stage's, sent back)."""
    result = samebits.diff(mixed_runs / reference, mixed_runs / run, by="global")
    report = result.to_dict()
    assert result.verdict is Verdict.IDENTICAL, report
    assert report["compared"]["steps"] == steps and report["compared"]["tensors"] == 25, report["compared"]
    replicated = compare_replicated(mixed_runs / reference, mixed_runs / run, phases=["metrics"])
    assert replicated.verdict is Verdict.IDENTICAL and replicated.compared["steps"] == steps, replicated.to_dict()


@pytest.mark.slow
@pytest.mark.parametrize("run, reference", [("tp2-dp2-plain-dp", "single-both"), ("fsdp2-plain", "single-grad"),
                                            ("pp2-plain", "single-grad"), ("ep2-plain", "single-grad")])
def test_control_without_grad_reduce_invariant_tp_x_dp_fsdp2_pp2_and_ep2_differ_from_one_rank(mixed_runs, run, reference):
    result = samebits.diff(mixed_runs / reference, mixed_runs / run, by="global")
    report = result.to_dict()
    assert result.verdict is Verdict.DIVERGED, report
    assert report["first_divergence"]["step"] == 0 and report["first_divergence"]["phase"] == "params"


# --- the worker -------------------------------------------------------------------------------


CONTROL_KS = (K_ROW, 192, 128, 448, 640, 384, 512)  # candidates for the plain-TP control's K


def _control_inputs(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randn(*TOKENS, k, generator=gen), torch.randn(N_ROW, k, generator=gen) * 0.05


def _row_control(group, rank: int, world_size: int) -> dict:
    """The negative control of the row-parallel layer, checked before use: the first K (whole
    blocks of 32 per share) where plain TP's all-reduced fp32 partials differ from the one-rank
    GEMM here, with the invariant layer's output on the same shares.  The choice is the same on
    every rank (both sides are whole tensors every rank holds)."""
    if group is None:
        return {}
    for k in CONTROL_KS:
        if k % (32 * world_size):
            continue
        x, w = _control_inputs(k)
        share = slice(rank * k // world_size, (rank + 1) * k // world_size)
        plain = x[..., share] @ w[:, share].t()
        torch.distributed.all_reduce(plain, group=group)
        if not torch.equal(plain, x @ w.t()):
            invariant = row_parallel_linear(x[..., share].clone(), w[:, share].clone(), group).detach()
            return {"control_k": k, "plain_row_y": plain, "control_row_y": invariant}
    return {"control_k": None}


def _layer_results(group, rank: int, world_size: int) -> dict:
    """Both layers on this rank's share (rank order, contiguous) of the same full tensors."""
    gen = torch.Generator().manual_seed(28)
    x_row = torch.randn(*TOKENS, K_ROW, generator=gen)
    w_row = torch.randn(N_ROW, K_ROW, generator=gen) * 0.05
    x_col = torch.randn(*TOKENS, K_COL, generator=gen)
    w_col = torch.randn(N_COL, K_COL, generator=gen) * 0.05
    g_row = torch.randn(*TOKENS, N_ROW, generator=gen)
    g_col = torch.randn(*TOKENS, N_COL, generator=gen)
    k, n = K_ROW // world_size, N_COL // world_size
    mine_k, mine_n = slice(rank * k, (rank + 1) * k), slice(rank * n, (rank + 1) * n)

    x_r = x_row[..., mine_k].clone().requires_grad_()
    w_r = w_row[:, mine_k].clone().requires_grad_()
    row_y = row_parallel_linear(x_r, w_r, group)
    row_y.backward(g_row)
    x_c = x_col.clone().requires_grad_()
    w_c = w_col[mine_n].clone().requires_grad_()
    col_y = column_parallel_linear(x_c, w_c, group)
    col_y.backward(g_col[..., mine_n])
    # a tensor split over the ranks (the column weight's grad) and a replicated one
    norm = sharded_grad_norm([w_c.grad, x_c.grad], full_numels=[w_col.numel(), x_col.numel()], group=group)
    # a norm's weight under sequence parallelism: each rank holds some positions
    y_seq = torch.randn(2, 8, K_COL, generator=gen)
    g_seq = torch.randn(2, 8, K_COL, generator=gen)
    positions = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    w_norm = torch.randn(K_COL, generator=gen).requires_grad_()
    scale_columns(y_seq[:, positions], w_norm, group).backward(g_seq[:, positions])
    out = {"row_y": row_y.detach(), "row_grad_x": x_r.grad, "row_grad_w": w_r.grad, "col_y": col_y.detach(),
           "col_grad_x": x_c.grad, "col_grad_w": w_c.grad, "norm": norm, "sp_norm_grad_w": w_norm.grad}
    out.update(_row_control(group, rank, world_size))
    if group is not None:
        try:
            invariant_matmul(torch.zeros(3, 48), torch.zeros(48, 2), group=group)
        except ConfigError as err:
            out["uneven"] = str(err)
    out.update(_fsdp_results(group, rank, world_size, gen))
    # pipeline stages: tensor i whole on rank i % W, empty elsewhere (replicated=False), and
    # the control without the flags (a tensor whole on rank 1 is taken for a replica)
    stage_tensors = [torch.randn(5 + i, generator=gen) for i in range(4)]
    held = [t if i % world_size == rank else t[:0] for i, t in enumerate(stage_tensors)]
    numels = [t.numel() for t in stage_tensors]
    out["pp_norm"] = sharded_grad_norm(held, full_numels=numels, group=group, replicated=[False] * 4)
    out["pp_norm_unflagged"] = sharded_grad_norm(held, full_numels=numels, group=group)
    return out


def _fsdp_results(group, rank: int, world_size: int, gen: torch.Generator) -> dict:
    """4 micro-batches of a flat buffer, this rank's k = 4 / W of them through
    `InvariantReduceScatter` (FSDP2's call: the whole buffer in, this rank's shard out; at
    world 1 the whole sum).  The control: the 4 micro-batches of this rank's shard summed in
    blocks of 16 cut from the shard (the block fixed point on one rank), as a reduction blocking FSDP2's
    buffer by rank would (at 4 ranks a shard of 24 ends inside a block of the whole buffer)."""
    scales = torch.pow(2.0, torch.randint(-30, 30, (FSDP_BUFFER,), generator=gen).double()).float()
    buffers = [torch.randn(FSDP_BUFFER, generator=gen) * scales for _ in range(4)]
    k, share = 4 // world_size, FSDP_BUFFER // world_size
    comm = InvariantReduceScatter(num_micro_batches=4, group=group)
    shard = torch.empty(share)
    for buffer in buffers[rank * k:(rank + 1) * k]:
        comm(shard, buffer, group, None)
    pad = -share % 16
    mine = [torch.cat([b[rank * share:(rank + 1) * share], torch.zeros(pad)]).reshape(-1, 16) for b in buffers]
    exps = torch.stack([block_exponents(m) for m in mine]).amax(dim=0)  # what reduce_blocks does on one rank
    bits = fraction_bits(4)
    blocked = decode(sum(encode(m, exps, bits)[0] for m in mine), exps, bits).reshape(-1)[:share]
    return {"fsdp_shard": shard, "fsdp_stats": comm.last_stats.inexact_elements, "blocked_shard": blocked}


def _worker(out_dir: Path, mode: str) -> None:
    from samebits.recipes.cli import main

    if mode == "single":
        for label, overrides, steps, cells in JOBS:
            if "single" in cells:
                _run_recipe(main, "single", label, overrides, steps, out_dir)
        return
    if mode == "mixed-single":
        for label, overrides, steps, cell in MIXED_JOBS:
            if cell == "single":
                _run_recipe(main, cell, label, overrides, steps, out_dir)
        return
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if mode == "layers":
        torch.save(_layer_results(dist.group.WORLD, rank, world_size), out_dir / f"layers-{world_size}-{rank}.pt")
    elif mode.startswith("mixed-"):  # the cell's MIXED_JOBS, in this group
        for label, overrides, steps, cell in MIXED_JOBS:
            if cell == mode.removeprefix("mixed-"):
                _run_recipe(main, cell, label, overrides, steps, out_dir)
    else:
        for label, overrides, steps, cells in JOBS:
            if "tp2" in cells:
                _run_recipe(main, "tp2", label, overrides, steps, out_dir)
    dist.destroy_process_group()


def _run_recipe(main, cell: str, label: str, overrides: list[str], steps: int, out_dir: Path) -> None:
    argv = ["--cell", cell, "--steps", str(steps), "--out", str(out_dir / f"{cell}-{label}")]
    for assignment in [*TINY, *overrides]:
        argv += ["--set", assignment]
    if main(argv) != 0:
        raise SystemExit(f"{cell}-{label}: failed")


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2])
