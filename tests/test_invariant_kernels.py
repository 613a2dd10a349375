"""Byte tests of the layout-invariant autograd Functions (registered in
src/samebits/kernels/kernel-coverage.toml, so `samebits coverage` judges them):

* `invariant._matmul._ColumnParallel` / `_RowParallel` (the TP linears of `tp_reduce=invariant`):
  output, input and weight gradients repeat bit for bit at 1 and 2 threads, and at one rank in
  mode="exact" the two layers are the same function (both are `invariant_matmul` over the whole
  K); in the default mode "gemm" they are not (the row layer's forward adds GEMM leaves by the
  tree its split needs, the column layer's is one GEMM), and both agree with a plain linear;
* `invariant._matmul._ScaleColumns` (a norm's weight under SP): repeats, and its weight gradient
  is `invariant_sum` of grad * y;
* `recipes.parallelize._SliceSequence` / `_GatherSequence` (the SP stream's entry and exit):
  on a one-rank gloo group each is the identity and its backward the reverse (the 2- and 4-rank
  splits are checked against one rank in tests/test_layout_invariance.py);
* `invariant._matmul._GatherColumns` (the torchtitan LM head's logits, joined): on a one-rank
  group it is the identity and its gradient the block's (tp2 and fsdp2-tp2 against one rank:
  the slow tests/test_torchtitan_invariant.py);
* `recipes.model._InvariantExperts` (the experts under grad_reduce=invariant): output, input and
  weight gradients repeat bit for bit at 1 and 2 threads (that each source's rows are those it
  gives alone: tests/test_expert_invariance.py).

Each would fail if its Function changed its bits between runs or threads, or stopped being
what the layouts rely on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from samebits.invariant import column_parallel_linear, gather_columns, invariant_sum, row_parallel_linear, scale_columns
from samebits.recipes.model import GroupedExperts
from samebits.recipes.parallelize import _GatherSequence, _SliceSequence
from samebits.testing import assert_same_bits


def _inputs(rows=6, k=64, n=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, rows, k, generator=gen).requires_grad_(True)
    weight = (torch.randn(n, k, generator=gen) * 0.1).requires_grad_(True)
    return x, weight


@pytest.mark.bitwise(runs=2, threads=[1, 2])
def test_column_parallel_linear_repeats():
    x, weight = _inputs()
    return column_parallel_linear(x, weight), x, weight  # the output; grads of x and weight


@pytest.mark.bitwise(runs=2, threads=[1, 2])
def test_row_parallel_linear_repeats():
    x, weight = _inputs(seed=1)
    return row_parallel_linear(x, weight), x, weight


def _both_layers(x, weight, mode):
    outs = []
    for layer in (column_parallel_linear, row_parallel_linear):
        out = layer(x, weight, mode=mode)
        out.square().sum().backward()
        outs.append((out.detach(), x.grad.clone(), weight.grad.clone()))
        x.grad = weight.grad = None
    return outs


def test_column_and_row_parallel_are_one_function_at_one_rank_in_exact_mode():
    x, weight = _inputs(seed=2)
    column, row = _both_layers(x, weight, "exact")
    for got, expected in zip(row, column):
        assert_same_bits(expected, got)


def test_column_and_row_parallel_in_gemm_mode_agree_with_a_plain_linear():
    x, weight = _inputs(seed=2)
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    plain = torch.nn.functional.linear(x_ref, w_ref)
    plain.square().sum().backward()
    for out, grad_x, grad_w in _both_layers(x, weight, "gemm"):
        torch.testing.assert_close(out, plain.detach())
        torch.testing.assert_close(grad_x, x_ref.grad)
        torch.testing.assert_close(grad_w, w_ref.grad)


@pytest.mark.bitwise(runs=2, threads=[1, 2])
def test_scale_columns_repeats():
    gen = torch.Generator().manual_seed(3)
    y = torch.randn(2, 10, 16, generator=gen).requires_grad_(True)
    weight = torch.randn(16, generator=gen).requires_grad_(True)
    return scale_columns(y, weight), y, weight


def test_scale_columns_weight_gradient_is_the_invariant_sum():
    gen = torch.Generator().manual_seed(4)
    y = torch.randn(2, 10, 16, generator=gen)
    weight = torch.randn(16, generator=gen).requires_grad_(True)
    grad = torch.randn(2, 10, 16, generator=gen)
    out = scale_columns(y, weight)
    out.backward(grad)
    assert_same_bits(out.detach(), y * weight.detach())
    assert_same_bits(weight.grad, invariant_sum(grad * y))


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('sp') / 'init'}",
                            rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.bitwise(runs=2)
@pytest.mark.parametrize("function", [_SliceSequence, _GatherSequence], ids=["slice", "gather"])
def test_sequence_entry_and_exit_are_the_identity_at_one_rank(one_rank_group, function):
    stream = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4).requires_grad_(True)
    out = function.apply(stream * 1.5, one_rank_group)
    assert_same_bits(out.detach(), stream.detach() * 1.5)  # one rank holds every position
    return out, stream  # the output; the gradient through the reverse collective


@pytest.mark.bitwise(runs=2)
def test_gathered_columns_are_the_block_at_one_rank_and_the_gradient_its_block(one_rank_group):
    block = torch.arange(2 * 3 * 8, dtype=torch.float32).view(2, 3, 8).requires_grad_(True)
    out = gather_columns(block * 0.5, one_rank_group)
    assert_same_bits(out.detach(), block.detach() * 0.5)  # one rank holds every column
    assert gather_columns(block, None) is block  # no group: the columns are all here
    return out, block  # the output; the gradient through the block's slice


@pytest.mark.bitwise(runs=2, threads=[1, 2])
def test_invariant_experts_repeat():
    gen = torch.Generator().manual_seed(5)
    experts = GroupedExperts(3, 32, 48)
    with torch.no_grad():
        experts.w1.normal_(0.0, 0.2, generator=gen)
        experts.w2.normal_(0.0, 0.2, generator=gen)
    experts.invariant = True
    counts = torch.tensor([3, 40, 9])  # one expert below the 4 rows a GEMM needs for a row's bits to be its own
    rows = torch.randn(int(counts.sum()), 32, generator=gen).requires_grad_(True)
    return experts(rows, counts, None, "torch"), rows, experts.w1, experts.w2
