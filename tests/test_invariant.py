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
from samebits.invariant import (DEFAULT_BLOCK_SIZE, TP_BLOCK_SIZE, GradientAccumulator, Preconditions, block_exponents,
                                canonical_grad_norm, column_parallel_linear, decode, encode, fraction_bits,
                                invariant_matmul, invariant_sum, micro_batch_seed, row_parallel_linear, scale_columns,
                                sharded_grad_norm)
from samebits.invariant import gemm_matmul, tree_matmul
from samebits.runners._launch import run_logged
from samebits.cli._recipe import across_size_layouts
from samebits.runners.across import command_layouts, compare_replicated, verify_across
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


def test_the_cheap_manual_seed_leaves_the_same_generator_state_as_torchs():
    from samebits.invariant import manual_seed

    for seed in (0, 7, micro_batch_seed(5, 3, 2), 2**63 - 1):
        torch.manual_seed(seed)
        expected = torch.get_rng_state()
        torch.rand(5)  # move it on
        manual_seed(seed)
        assert torch.equal(torch.get_rng_state(), expected)


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
        _SHARED["across"] = verify_across(command_layouts([1, 2, 4], _cmd("--steps", "20", "--ckpt", "{out}/ckpt")), out)
    return _SHARED["across"]


def _cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{nproc}",
            str(SCRIPT), "--out", "{out}", *extra]


@pytest.mark.slow
def test_training_is_bit_identical_at_dp_1_2_and_4(invariant_runs):
    result = invariant_runs
    assert result.verdict is Verdict.PASS, result.to_dict()
    for name, check in result.checks.items():
        assert check.compared["steps"] == 20 and check.compared["records"] >= 20 * 13, (name, check.compared)
        assert f"dp{check.compared['world_size_b']}" == name


@pytest.mark.slow
def test_the_recipe_in_invariant_mode_is_bit_identical_at_dp_1_and_2(tmp_path):
    """The reference recipe (MoE with replicated experts, dropout, router jitter, MTP) through
    `verify --across`'s recipe path; `samebits verify --across dp=1,2,4 --steps 20` is the
    full check (benchmarks/RESULTS.md)."""
    result = verify_across(across_size_layouts([1, 2], steps=2), tmp_path / "recipe")
    assert result.verdict is Verdict.PASS, result.to_dict()
    assert result.checks["dp2"].compared["steps"] == 2


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


# --- tensor-parallel products (invariant_matmul, the TP linears, the sharded norm) ---------------
# Splits over real ranks (tp = 2, 4) are checked in tests/test_layout_invariance.py.


def _operands(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 3, k)[torch.randperm(k, generator=gen)]  # magnitudes mixed inside blocks
    return torch.randn(m, k, generator=gen) * spread, torch.randn(k, n, generator=gen)


def test_torch_gemm_bits_depend_on_m_and_n_but_invariant_matmul_does_not():
    """Measured here: torch's fp32 CPU GEMM computes an element differently when M or N is 1
    (another kernel), so a per-block product by torch.matmul would not be invariant; the
    block fixed-point product is exact, so any slice gives the same bits, at any thread count."""
    a, b = _operands(64, 96, 48, seed=0)
    full, plain = invariant_matmul(a, b), a @ b
    shapes = [(1, 48), (64, 1), (1, 1), (3, 5), (17, 48), (64, 33)]
    for m, n in shapes:
        assert torch.equal(invariant_matmul(a[:m], b[:, :n]), full[:m, :n]), (m, n)
        assert torch.equal(invariant_matmul(a[-m:], b[:, -n:]), full[-m:, -n:]), (m, n)
    assert any(not torch.equal(a[:m] @ b[:, :n], plain[:m, :n]) for m, n in shapes)
    torch.set_num_threads(2)
    try:
        assert torch.equal(invariant_matmul(a, b), full)
    finally:
        torch.set_num_threads(1)


def _block_fixed_point(values: list[float]) -> list[Fraction]:
    """One block of fp32 values as the exact values the product uses: each rounded (half to
    even) to a multiple of 2**(e - 24), e the smallest with |x| < 2**e over the block."""
    peak = max(abs(v) for v in values)
    if peak == 0:
        return [Fraction(0)] * len(values)
    e = int(np.frexp(np.float64(peak))[1])
    quantum = Fraction(2) ** (e - 24)
    return [round(Fraction(v) / quantum) * quantum for v in values]


def test_invariant_matmul_is_the_correctly_rounded_sum_of_the_block_fixed_point_products():
    a, b = _operands(3, 2 * TP_BLOCK_SIZE, 2, seed=1)
    out = invariant_matmul(a, b)
    for i in range(3):
        for j in range(2):
            exact = Fraction(0)
            for start in range(0, a.shape[1], TP_BLOCK_SIZE):
                xs = _block_fixed_point([float(v) for v in a[i, start:start + TP_BLOCK_SIZE]])
                ws = _block_fixed_point([float(v) for v in b[start:start + TP_BLOCK_SIZE, j]])
                exact += sum(x * w for x, w in zip(xs, ws))
            assert out[i, j].numpy() == _round_f32(exact), (i, j)


def test_a_reordering_of_whole_blocks_of_k_keeps_the_bits_and_plain_fp32_does_not():
    a, b = _operands(40, 8 * TP_BLOCK_SIZE, 24, seed=2)
    blocks = torch.arange(a.shape[1]).view(-1, TP_BLOCK_SIZE)
    order = blocks[torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])].reshape(-1)
    assert torch.equal(invariant_matmul(a[:, order], b[order]), invariant_matmul(a, b))
    assert not torch.equal(a[:, order] @ b[order], a @ b)
    # as accurate as torch's fp32 GEMM against fp64, here (benchmarks/bench_tp_invariant.py measures more)
    reference = a.double() @ b.double()
    assert (invariant_matmul(a, b) - reference).abs().max() <= (a @ b - reference).abs().max() * 2


def test_nonfinite_inputs_make_only_their_rows_and_columns_nan():
    a, b = _operands(6, TP_BLOCK_SIZE, 5, seed=3)
    clean = invariant_matmul(a, b)
    a[2, 7], b[4, 3] = float("inf"), float("nan")
    out = invariant_matmul(a, b)
    assert out[2].isnan().all() and out[:, 3].isnan().all()
    keep = torch.ones_like(out, dtype=torch.bool)
    keep[2], keep[:, 3] = False, False
    assert torch.equal(out[keep], clean[keep])


@pytest.mark.parametrize("layer", [column_parallel_linear, row_parallel_linear])
def test_tp_linear_layers_forward_and_backward_are_block_products_in_exact_mode(layer):
    """mode="exact": on one rank each layer is x @ w.T with every product, forward and backward,
    an `invariant_matmul` (14 tokens: the token reduction of the weight gradient is padded to
    whole blocks); the gradients agree with a plain linear's to fp32 accuracy."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 64, generator=gen, requires_grad=True)
    w = (torch.randn(96, 64, generator=gen) * 0.1).requires_grad_()
    grad = torch.randn(2, 7, 96, generator=gen)
    y = layer(x, w, mode="exact")
    y.backward(grad)
    assert torch.equal(y, invariant_matmul(x.detach(), w.detach().t()))
    assert torch.equal(x.grad, invariant_matmul(grad.reshape(14, 96), w.detach()).view(2, 7, 64))
    assert torch.equal(w.grad, invariant_matmul(grad.reshape(14, 96).t().contiguous(), x.detach().reshape(14, 64)))
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = torch.nn.functional.linear(x_ref, w_ref)
    y_ref.backward(grad)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)


@pytest.mark.parametrize("column", [True, False])
def test_tp_linear_layers_default_to_gemm_leaves_whole_k_by_gemm_and_split_k_by_the_tree(column):
    """The default mode ("gemm"): a product whose K is whole on every rank is `gemm_matmul`,
    one whose K the ranks split (the row layer's forward, the column layer's input gradient)
    is `tree_matmul`; everything agrees with a plain linear to fp32 accuracy."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 64, generator=gen, requires_grad=True)
    w = (torch.randn(96, 64, generator=gen) * 0.1).requires_grad_()
    grad = torch.randn(2, 7, 96, generator=gen)
    y = (column_parallel_linear if column else row_parallel_linear)(x, w)
    y.backward(grad)
    x2, g2, wd = x.detach().reshape(14, 64), grad.reshape(14, 96), w.detach()
    forward, grad_x = (gemm_matmul, tree_matmul) if column else (tree_matmul, gemm_matmul)
    assert torch.equal(y.reshape(14, 96), forward(x2, wd.t()))
    assert torch.equal(x.grad.reshape(14, 64), grad_x(g2, wd))
    assert torch.equal(w.grad, gemm_matmul(g2.t(), x2))
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(x_ref, w_ref).backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(w.grad, w_ref.grad)
    with pytest.raises(ConfigError, match="mode='fast'.*gemm, exact"):
        column_parallel_linear(x, w, mode="fast")


def test_gemm_matmul_bits_depend_on_the_row_and_column_only_at_any_shape_and_thread_count():
    """Measured here (benchmarks/gemm_block_bits.py): torch's fp32 GEMM takes another kernel
    when M < 4 or N < 12 rows or columns, or when its threads cut M or N into tiles that small;
    `gemm_matmul` pads M and N and runs on one thread, so any slice, offset, stride or thread
    count gives the element the same bits (a@b itself does not: checked alongside)."""
    gen = torch.Generator().manual_seed(7)
    a, b = torch.randn(64, 256, generator=gen), torch.randn(256, 48, generator=gen)
    full = gemm_matmul(a, b)
    shapes = [(1, 48), (64, 1), (1, 1), (3, 5), (5, 11), (17, 48), (64, 33), (9, 24)]
    for m, n in shapes:
        assert torch.equal(gemm_matmul(a[:m], b[:, :n]), full[:m, :n]), (m, n)
        assert torch.equal(gemm_matmul(a[-m:], b[:, -n:]), full[-m:, -n:]), (m, n)
        assert torch.equal(gemm_matmul(a.t().contiguous().t()[:m], b.t().contiguous()[:n].t()), full[:m, :n])
    assert any(not torch.equal(a[:m] @ b[:, :n], (a @ b)[:m, :n]) for m, n in shapes)
    for threads in (2, 3):
        torch.set_num_threads(threads)
        try:
            assert torch.equal(gemm_matmul(a[:9], b[:, :24]), full[:9, :24]), threads
            assert torch.equal(tree_matmul(a[:9], b[:, :24]), tree_matmul(a, b)[:9, :24]), threads
        finally:
            torch.set_num_threads(1)


def test_tree_matmul_adds_gemm_leaves_by_one_binary_tree_so_a_share_is_a_subtree():
    """K = 256 in blocks of 32: gcd(8, 8) = 8 leaves of 32, added pairwise ((0+1)+(2+3))+...;
    the sum of rank r's half at tp=2 (a `tree_matmul` of the half alone) is the tree's left or
    right subtree, and their sum is the whole: what the all-gather of the ranks' partials adds.
    K = 192: gcd(6, 8) = 2 leaves of 96.  A plain left-to-right sum of the leaves differs."""
    gen = torch.Generator().manual_seed(8)
    a, b = torch.randn(16, 256, generator=gen), torch.randn(256, 24, generator=gen)
    leaves = [gemm_matmul(a[:, i * 32:(i + 1) * 32], b[i * 32:(i + 1) * 32]) for i in range(8)]
    pairs = [leaves[i] + leaves[i + 1] for i in range(0, 8, 2)]
    left, right = pairs[0] + pairs[1], pairs[2] + pairs[3]
    assert torch.equal(tree_matmul(a, b), left + right)
    assert torch.equal(tree_matmul(a[:, :128], b[:128]), left)
    assert torch.equal(tree_matmul(a[:, 128:], b[128:]), right)
    sequential = leaves[0]
    for leaf in leaves[1:]:
        sequential = sequential + leaf
    assert not torch.equal(sequential, left + right)
    a6, b6 = a[:, :192], b[:192]
    assert torch.equal(tree_matmul(a6, b6), gemm_matmul(a6[:, :96], b6[:96]) + gemm_matmul(a6[:, 96:], b6[96:]))
    torch.testing.assert_close(tree_matmul(a, b), (a.double() @ b.double()).float())


def test_invariant_matmul_refuses_what_it_cannot_make_exact():
    a, b = _operands(4, TP_BLOCK_SIZE, 3, seed=5)
    with pytest.raises(ConfigError, match="fp32 operands.*bfloat16"):
        invariant_matmul(a.bfloat16(), b)
    with pytest.raises(ConfigError, match=r"cannot multiply \(4, 32\) by \(3, 32\)"):
        invariant_matmul(a, b.t())
    with pytest.raises(ConfigError, match="block_size=64.*at most 32"):
        invariant_matmul(a, b, block_size=64)


def test_sharded_norm_is_accurate_and_does_not_depend_on_element_order():
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(300, generator=gen) * 1e-3, torch.randn(7, 9, generator=gen), torch.zeros(5)]
    norm = sharded_grad_norm(grads)
    exact = torch.cat([g.reshape(-1) for g in grads]).double().norm()
    assert norm.dtype == torch.float32 and float(norm) == pytest.approx(float(exact), rel=1e-7)
    shuffled = [g.reshape(-1)[torch.randperm(g.numel(), generator=gen)] for g in grads]
    assert torch.equal(sharded_grad_norm(shuffled), norm)
    with pytest.raises(ConfigError, match="gradient 1 is a shard .63 of 126 elements. but no group"):
        sharded_grad_norm(grads, full_numels=[300, 126, 5])
    with pytest.raises(ConfigError, match="gradient 0 holds 300 elements, more than .* 10"):
        sharded_grad_norm(grads, full_numels=[10, 63, 5])
    assert sharded_grad_norm([torch.tensor([1.0, float("nan")])]).isnan()
    # a part another rank counts (counted False) is left out: the norm of the rest, the same bits
    assert torch.equal(sharded_grad_norm(grads, counted=[True, False, True]), sharded_grad_norm([grads[0], grads[2]]))
    with pytest.raises(ConfigError, match="3 gradients but 2 counted flags"):
        sharded_grad_norm(grads, counted=[True, False])


def test_invariant_sum_over_rows_is_correctly_rounded_in_any_row_order():
    """The sum over positions of a norm's weight gradient: one block per column, exact."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 10, 16, generator=gen) * torch.logspace(-2, 2, 16)
    total = invariant_sum(x)
    rows = x.reshape(30, 16)
    for col in range(16):
        assert total[col].numpy() == _round_f32(sum(Fraction(float(v)) for v in rows[:, col])), col
    assert torch.equal(invariant_sum(rows[torch.randperm(30, generator=gen)]), total)
    assert not all(torch.equal(rows[perm].sum(dim=0), rows.sum(dim=0))  # plain fp32: the order shows
                   for perm in (torch.randperm(30, generator=gen) for _ in range(8)))


def test_scale_columns_is_a_product_whose_weight_gradient_is_the_invariant_sum():
    gen = torch.Generator().manual_seed(8)
    y = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    w = torch.randn(8, generator=gen, requires_grad=True)
    grad = torch.randn(2, 5, 8, generator=gen)
    out = scale_columns(y, w)
    out.backward(grad)
    assert torch.equal(out, y.detach() * w.detach())
    assert torch.equal(y.grad, grad * w.detach())
    assert torch.equal(w.grad, invariant_sum(grad * y.detach()))
