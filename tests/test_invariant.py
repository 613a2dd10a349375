"""Invariant gradient reduction (samebits.invariant): the fixed-point arithmetic, the
preconditions, and the proof that training gives the same bits at DP = 1, 2 and 4.

The multi-process tests launch tests/scripts_invariant/train_dp.py with torchrun (gloo) at
each size through `verify_across`; the control runs the same loop with the usual fp32
accumulation and all-reduce and must be caught differing between DP=1 and DP=2.
"""

from __future__ import annotations

import itertools
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from samebits.errors import ConfigError
from samebits.invariant import (DEFAULT_BLOCK_SIZE, GradientAccumulator, Preconditions, block_exponents, canonical_grad_norm, decode,
                                encode, fraction_bits, micro_batch_seed)
from samebits.runs._launch import run_logged
from samebits.runs.across import compare_replicated, verify_across
from samebits.verdicts import Verdict

SCRIPT = Path(__file__).parent / "scripts_invariant" / "train_dp.py"


def _round_f32(exact: Fraction) -> np.float32:
    """The fp32 nearest to ``exact`` (ties to even), decided exactly."""
    guess = np.float32(float(exact))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.array(v).view(np.uint32)) & 1))


def _invariant_sum(parts: list[torch.Tensor], num_micro_batches: int) -> torch.Tensor:
    bits = fraction_bits(num_micro_batches)
    exps = block_exponents(parts[0])
    for part in parts[1:]:
        exps = torch.maximum(exps, block_exponents(part))
    total = torch.zeros(parts[0].shape, dtype=torch.int64)
    for part in parts:
        total += encode(part, exps, bits)[0]
    return decode(total, exps, bits)


def _mixed_scales(num: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-4, 4, 16)[:, None]  # each block its own magnitude
    return [(torch.randn(16, DEFAULT_BLOCK_SIZE, generator=gen) * scales).float() for _ in range(num)]


def test_sum_is_correctly_rounded_and_the_same_in_every_order_and_grouping():
    parts = _mixed_scales(4, seed=0)
    reference = _invariant_sum(parts, 4)
    plain = set()
    for order in itertools.permutations(range(4)):
        shuffled = [parts[i] for i in order]
        # grouped as two ranks of two micro-batches, each rank's int64 partial summed after
        bits, exps = fraction_bits(4), torch.maximum(*[block_exponents(torch.stack(shuffled).abs().amax(0))] * 2)
        halves = [sum(encode(p, exps, bits)[0] for p in shuffled[:2]), sum(encode(p, exps, bits)[0] for p in shuffled[2:])]
        assert torch.equal(decode(halves[1] + halves[0], exps, bits).view(torch.int32), reference.view(torch.int32))
        assert torch.equal(_invariant_sum(shuffled, 4).view(torch.int32), reference.view(torch.int32))
        fp32 = (shuffled[0] + shuffled[1]) + (shuffled[2] + shuffled[3])
        plain.add(fp32.view(torch.int32).numpy().tobytes())
    assert len(plain) > 1, "control: fp32 sums in other orders should differ somewhere (else the test shows nothing)"
    stacked = torch.stack(parts).double()
    for row in range(0, 16, 3):
        for col in range(0, DEFAULT_BLOCK_SIZE, 17):
            exact = sum(Fraction(float(stacked[k, row, col])) for k in range(4))
            assert _round_f32(exact) == np.float32(reference[row, col]), (row, col)


def test_subnormal_results_are_rounded_once():
    values = torch.zeros(2, DEFAULT_BLOCK_SIZE)
    values[0, :4] = torch.tensor([3e-42, -1.4e-45, 1e-39, 1.1754942e-38])
    half = values / 2  # two halves that sum back to the values (exact: a power of two)
    assert torch.equal(_invariant_sum([half, values - half], 2).view(torch.int32), values.view(torch.int32))


def test_a_block_spanning_many_decades_is_flagged_and_stays_invariant():
    block = torch.ones(1, DEFAULT_BLOCK_SIZE)
    block[0, :128] = torch.logspace(-30, 10, 128)  # 40 decades in one block
    parts = [block * s for s in (1.0, -0.75, 0.5, 0.3)]
    bits = fraction_bits(4)
    exps = block_exponents(torch.stack(parts).abs().amax(0))
    inexact = sum(encode(p, exps, bits)[1] for p in parts)
    assert inexact > 0  # flagged: elements far below the block's max lost low bits
    a = _invariant_sum(parts, 4)
    b = _invariant_sum(parts[::-1], 4)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    # elements within P - 24 binary orders of the maximum are still correctly rounded
    big = (block[0].abs() > block[0].abs().max() * 2.0 ** -(bits - 26))
    exact = [_round_f32(sum(Fraction(float(p[0, i])) for p in parts)) for i in range(DEFAULT_BLOCK_SIZE)]
    assert all(exact[i] == np.float32(a[0, i]) for i in range(DEFAULT_BLOCK_SIZE) if big[i])


def test_a_block_of_milder_spread_encodes_exactly():
    parts = _mixed_scales(4, seed=3)
    bits = fraction_bits(4)
    exps = block_exponents(torch.stack(parts).abs().amax(0))
    assert sum(encode(p, exps, bits)[1] for p in parts) == 0


def test_nonfinite_gradient_reduces_to_nan_in_its_block_only():
    parts = _mixed_scales(2, seed=1)
    parts[1][3, 5] = float("inf")
    out = _invariant_sum(parts, 2)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[:3]).all() and torch.isfinite(out[4:]).all()


def test_headroom_bits_leave_room_for_every_micro_batch():
    for m in (1, 2, 3, 4, 1000, 2 ** 20):
        assert m * 2 ** fraction_bits(m) <= 2 ** 62
    with pytest.raises(ConfigError, match="num_micro_batches"):
        fraction_bits(2 ** 40)
    # the worst case: every micro-batch at its block's maximum, all the same sign
    parts = [torch.full((1, DEFAULT_BLOCK_SIZE), -(2.0 - 2 ** -23)) for _ in range(3)]
    assert float(_invariant_sum(parts, 3)[0, 0]) == pytest.approx(-3 * (2.0 - 2 ** -23))


@pytest.mark.parametrize("settings, named", [
    (dict(rng_key="rank"), "rng_key='rank'"),
    (dict(rng_key="dp_rank"), "rng_key='dp_rank'"),
    (dict(num_micro_batches=6, world_size=4), "num_micro_batches=6 is not divisible"),
    (dict(loss_normalization="local_mean"), "loss_normalization='local_mean'"),
    (dict(micro_batch_size=0), "micro_batch_size=0"),
])
def test_preconditions_refuse_what_breaks_invariance(settings, named):
    values = dict(num_micro_batches=4, world_size=2, micro_batch_size=8) | settings
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        Preconditions(**values).check()
    Preconditions(num_micro_batches=4, world_size=2, micro_batch_size=8).check()  # the good one passes


def test_accumulator_refuses_a_rank_keyed_rng_and_miscounted_micro_batches():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match="rng_key='rank'"):
        GradientAccumulator(model.named_parameters(), num_micro_batches=2, rng_key="rank")
    acc = GradientAccumulator(model.named_parameters(), num_micro_batches=2)
    assert list(acc.micro_batches()) == [0, 1]
    model(torch.ones(1, 3)).sum().backward()
    acc.accumulate()
    with pytest.raises(Exception, match="reduce\\(\\) after 1 micro-batches"):
        acc.reduce()


def test_micro_batch_rng_depends_on_step_and_micro_batch_only():
    acc = GradientAccumulator(torch.nn.Linear(2, 2).named_parameters(), num_micro_batches=4, seed=5)
    with acc.micro_batch(3, 2):
        first = torch.rand(4)
    torch.rand(10)  # whatever happened on this rank before
    with acc.micro_batch(3, 2):
        again = torch.rand(4)
    with acc.micro_batch(3, 1):
        other = torch.rand(4)
    assert torch.equal(first, again) and not torch.equal(first, other)
    jitter = torch.Generator().manual_seed(11)
    before = jitter.get_state()
    with acc.micro_batch(3, 2, generators=[jitter]):
        drawn = torch.rand(3, generator=jitter)
    with acc.micro_batch(3, 2, generators=[jitter]):
        assert torch.equal(torch.rand(3, generator=jitter), drawn)
    assert torch.equal(jitter.get_state(), before)  # restored: no trace of which micro-batches ran
    assert micro_batch_seed(5, 3, 2) != micro_batch_seed(5, 2, 3)


def test_canonical_norm_is_order_fixed():
    grads = [g[0] for g in _mixed_scales(1, seed=4)[0].split(1)]
    norm = canonical_grad_norm(grads)
    assert float(norm) == pytest.approx(float(torch.cat(grads).double().norm()), rel=1e-6)
    torch.set_num_threads(2)
    try:
        assert torch.equal(canonical_grad_norm(grads), norm)
    finally:
        torch.set_num_threads(1)


_SHARED: dict = {}  # the runs below, made once per session (tests/test_replay.py imports the fixture)


@pytest.fixture(scope="session")
def invariant_runs(tmp_path_factory):
    """The loop at DP = 1, 2, 4 (20 steps, M = 4 micro-batches, the state saved before every
    step in {out}/ckpt), compared with DP=1.  Shared with tests/test_replay.py."""
    if "across" not in _SHARED:
        out = tmp_path_factory.mktemp("across") / "out"
        _SHARED["across"] = verify_across([1, 2, 4], _cmd("--steps", "20", "--ckpt", "{out}/ckpt"), out)
    return _SHARED["across"]


def _cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{nproc}",
            str(SCRIPT), "--out", "{out}", *extra]


@pytest.mark.slow
def test_training_is_bit_identical_at_dp_1_2_and_4(invariant_runs):
    result = invariant_runs
    assert result.verdict is Verdict.PASS, result.to_dict()
    for size, check in result.checks.items():
        assert check.compared["steps"] == 20 and check.compared["records"] >= 20 * 13, (size, check.compared)
        assert check.compared["world_size_b"] == size


@pytest.mark.slow
def test_the_recipe_in_invariant_mode_is_bit_identical_at_dp_1_and_2(tmp_path):
    """The reference recipe (MoE with replicated experts, dropout, router jitter, MTP) through
    `verify --across`'s recipe path; `samebits verify --across dp=1,2,4 --steps 20` is the
    full check (benchmarks/RESULTS.md)."""
    result = verify_across([1, 2], None, tmp_path / "recipe", steps=2)
    assert result.verdict is Verdict.PASS, result.to_dict()
    assert result.checks[2].compared["steps"] == 2


@pytest.mark.slow
def test_the_ddp_comm_hook_gives_the_same_bits_as_the_accumulator(invariant_runs, tmp_path):
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
            "--steps", "20", "--ddp", "--out", str(tmp_path / "ddp2")]
    code, _ = run_logged(argv, tmp_path / "ddp2.log")
    assert code == 0, (tmp_path / "ddp2.log").read_text()[-2000:]
    check = compare_replicated(Path(invariant_runs.out) / "dp1", tmp_path / "ddp2")
    assert check.verdict is Verdict.IDENTICAL and check.compared["steps"] == 20, check.to_dict()


@pytest.mark.slow
def test_control_plain_fp32_reduction_differs_between_dp_1_and_2(tmp_path):
    train_dp = _script_module()
    assert train_dp.main(["--steps", "2", "--grad-reduce", "mean", "--out", str(tmp_path / "dp1")]) == 0
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
            "--steps", "2", "--grad-reduce", "mean", "--out", str(tmp_path / "dp2")]
    code, _ = run_logged(argv, tmp_path / "dp2.log")
    assert code == 0, (tmp_path / "dp2.log").read_text()[-2000:]
    check = compare_replicated(tmp_path / "dp1", tmp_path / "dp2")
    assert check.verdict is Verdict.DIVERGED and check.first_divergence.step == 0
    assert check.first_divergence.phase in ("grads", "metrics")  # the reduced gradient, before any update


def _script_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_dp  # noqa: PLC0415  (the test script, imported to run in this process)
    finally:
        sys.path.pop(0)
    return train_dp


def test_a_rank_keyed_training_loop_is_refused_before_it_trains(tmp_path, capsys):
    train_dp = _script_module()
    assert train_dp.main(["--steps", "1", "--rng-key", "rank", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "rng_key='rank'" in err and "(step, micro-batch)" in err
    assert not (tmp_path / "r").exists()
