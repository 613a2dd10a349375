"""Matrix products with the same bits however their reduction dimension is split over ranks:
the tensor-parallel linear layers of docs/invariance.md.

    invariant_matmul(a, b, group=None)        a (..., K_r) @ b (K_r, N); K = the ranks' K_r in rank order
    invariant_sum(x, group=None)              x (..., D) summed over its rows and every rank's rows
    scale_columns(y, weight, group=None)      y * weight; the weight gradient is an invariant_sum (SP norms)
    column_parallel_linear(x, w_shard, group)  y_r = x @ w_r.T      (N split; backward reduces over N)
    row_parallel_linear(x_shard, w_shard, group)  y = sum_r x_r @ w_r.T  (K split; forward reduces over K)

The reduction dimension K is cut into canonical blocks of ``TP_BLOCK_SIZE`` (32) consecutive
elements.  Each operand is put in block fixed point: within a block of ``a``'s row m (of
``b``'s column n), every element becomes an integer of at most 24 bits times one power of two,
the block's (``e``: the smallest with ``|x| < 2**e``, so the block's largest element keeps all
of its fp32 bits; smaller ones keep their bits down to 2**(e - 24)).  A block's product is a
sum of 32 products of two such integers, ``|sum| <= 32 * 2**48 = 2**53``: every partial sum is
an integer that fp64 holds exactly, so the fp64 GEMM of a block gives the exact block product
in any order, whatever kernel, M, N or thread count (measured: torch's fp32 CPU GEMM gives other
bits for the same element when M or N is 1, tests/test_invariant.py).  The block products are
then added in int64 fixed point at a quantum fixed by the whole row's and column's exponents
(an exact MAX all-reduce of M + N integers), locally and over the ranks (an int64 all-reduce:
associative, so any split, order or ring gives the same integer), and the sum is rounded to
fp32 once.  Every step depends on the values of whole canonical blocks only, never on where
the ranks' shares begin, so a K split over 1, 2, 4 ... ranks gives the same bits.

Accuracy: each element loses the bits below 2**(e - 24) of its block's exponent (none for an
element within a factor 2 of its block's largest); the sum truncates only what lies below
2**-62 of the row and column bound (blocks far below their row's largest), and rounds once;
measured against fp64 in benchmarks/bench_tp_invariant.py (as accurate as torch's fp32 GEMM
or better).  A row or column holding inf or nan gives nan, and
results in fp32's subnormal range may be rounded twice (still the same at every split).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from samebits._torchutil import group_rank_and_world_size
from samebits.errors import ConfigError
from samebits.invariant._fixed import block_exponents, decode, encode, fraction_bits, pow2_clamped

TP_BLOCK_SIZE = 32
_OPERAND_BITS = 24  # each operand's integers: |X| <= 2**24
_SUM_BITS = 62  # int64 sum: |S| <= 2**62, no overflow in any order
_ZERO_EXP = -4096  # exponent of an all-zero block (below every real one)
_NONFINITE_EXP = 4096  # exponent of a block holding inf or nan (above every real one)
_CHUNK_ELEMENTS = 1 << 22  # block products computed at once (fp64), to bound memory


def _block_exponents(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """int64 exponents of the blocks along ``dim``: the smallest e with |x| < 2**e;
    _ZERO_EXP for an all-zero block, _NONFINITE_EXP for one holding inf or nan."""
    peak = blocks.abs().amax(dim=dim)
    _, exp = torch.frexp(peak)  # peak = m * 2**exp, 0.5 <= m < 1
    exp = exp.to(torch.int64)
    exp = torch.where(peak > 0, exp, torch.full_like(exp, _ZERO_EXP))
    return torch.where(torch.isfinite(peak), exp, torch.full_like(exp, _NONFINITE_EXP))


def _to_integers(blocks: torch.Tensor, exps: torch.Tensor, dim: int) -> torch.Tensor:
    """fp64 integers round_half_even(x * 2**(24 - e)) of each block's elements (|X| <= 2**24);
    non-finite elements become 0 (their outputs are nan, see `invariant_matmul`)."""
    scale = pow2_clamped(_OPERAND_BITS - exps).unsqueeze(dim)
    values = blocks.nan_to_num(0.0, 0.0, 0.0).to(torch.float64)
    return torch.round(values * scale)  # a power-of-two scale is exact; one rounding here


def _check(a: torch.Tensor, b: torch.Tensor, world_size: int, block_size: int) -> None:
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ConfigError(f"invariant_matmul takes fp32 operands, got {a.dtype} @ {b.dtype}: keep the "
                          "layer in fp32 (tp_reduce=invariant runs with precision=fp32)")
    if b.dim() != 2 or a.dim() < 1 or a.shape[-1] != b.shape[0]:
        raise ConfigError(f"invariant_matmul: cannot multiply {tuple(a.shape)} by {tuple(b.shape)} "
                          "(a (..., K) @ b (K, N))")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
            or 2 * _OPERAND_BITS + math.ceil(math.log2(block_size)) > 53:
        raise ConfigError(f"block_size={block_size!r}: must be a positive int of at most 32 (a block's sum of "
                          "24-bit products must stay exact in fp64)")
    if world_size > 1 and a.shape[-1] % block_size:
        raise ConfigError(
            f"invariant_matmul: the reduction dimension is split over {world_size} ranks into "
            f"{a.shape[-1]} elements each, not a multiple of the block size {block_size}: each rank's "
            f"share must be whole blocks, so the full dimension ({a.shape[-1] * world_size}) must be a "
            f"multiple of {block_size * world_size}; change the layer sizes or the TP degree")


def invariant_matmul(a: torch.Tensor, b: torch.Tensor, *, group=None,
                     block_size: int = TP_BLOCK_SIZE) -> torch.Tensor:
    """``a (..., K_r) @ b (K_r, N)`` summed over the ranks of ``group`` -> (..., N) fp32, the
    same bits on every rank and however the full K is split (each rank holding a contiguous
    share, in rank order, of whole blocks).  ``group=None``: K is whole on this rank (no
    collective, not the default world group), zero-padded to whole blocks if need be.

    Not differentiable itself: `column_parallel_linear` and `row_parallel_linear` are.
    """
    world_size = 1 if group is None else group_rank_and_world_size(group)[1]
    _check(a, b, world_size, block_size)
    lead, k_local, n = a.shape[:-1], a.shape[-1], b.shape[1]
    a2 = a.reshape(-1, k_local)
    m = a2.shape[0]
    pad = (-k_local) % block_size  # only without a split (checked above)
    if pad:
        a2 = torch.nn.functional.pad(a2, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    num_blocks = (k_local + pad) // block_size
    a_blocks = a2.reshape(m, num_blocks, block_size)  # (M, nb, B)
    b_blocks = b.reshape(num_blocks, block_size, n)  # (nb, B, N)
    a_exp, b_exp = _block_exponents(a_blocks, 2), _block_exponents(b_blocks, 1)  # (M, nb), (nb, N)
    # The whole row's and column's exponents (over every rank's blocks): they fix the quantum.
    row_exp = a_exp.amax(dim=1) if num_blocks else torch.full((m,), _ZERO_EXP, dtype=torch.int64, device=a.device)
    col_exp = b_exp.amax(dim=0) if num_blocks else torch.full((n,), _ZERO_EXP, dtype=torch.int64, device=a.device)
    if world_size > 1:
        bounds = torch.cat([row_exp, col_exp])
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=group)  # exact: a max of integers
        row_exp, col_exp = bounds[:m], bounds[m:]
    # |row sum| <= K * 2**(e_row + e_col): in units of 2**(e_row + e_col + headroom - 62) it
    # fits int64 whatever the order.  The integers of each block are scaled by
    # 2**(e_block - e_row) (and the row's by 2**(62 - 48 - headroom)), so every block's terms
    # share one power of two per output element: each block product is exact in fp64 and
    # comes out directly in those units; its conversion to int64 truncates the bits below
    # one unit (2**-62 of the bound; only blocks far below it have any), the same at every split.
    total_blocks = num_blocks * world_size
    headroom = math.ceil(math.log2(total_blocks * block_size)) if total_blocks else 0
    to_units = _SUM_BITS - 2 * _OPERAND_BITS - headroom
    a_int = _to_integers(a_blocks, a_exp, 2) * pow2_clamped(a_exp - row_exp[:, None] + to_units)[:, :, None]
    b_int = _to_integers(b_blocks, b_exp, 1) * pow2_clamped(b_exp - col_exp[None, :])[:, None, :]
    total = torch.zeros(m, n, dtype=torch.int64, device=a.device)
    a_t = a_int.transpose(0, 1).contiguous()  # (nb, M, B)
    step = max(1, _CHUNK_ELEMENTS // max(1, m * n))
    for start in range(0, num_blocks, step):
        products = torch.matmul(a_t[start:start + step], b_int[start:start + step])  # exact, (c, M, N)
        total += products.to(torch.int64).sum(dim=0)  # int64: exact, any order
    if world_size > 1:
        dist.all_reduce(total, group=group)  # int64 SUM: exact and associative
    quantum = row_exp[:, None] + col_exp[None, :] + headroom - _SUM_BITS  # (M, N)
    # int64 -> fp32 rounds once (to nearest even); the power of two is exact (fp64 range).
    out = (total.to(torch.float32).to(torch.float64) * pow2_clamped(quantum)).to(torch.float32)
    nonfinite = (row_exp[:, None] == _NONFINITE_EXP) | (col_exp[None, :] == _NONFINITE_EXP)
    out = out.masked_fill(nonfinite, float("nan"))  # no host sync: always applied
    return out.reshape(*lead, n)


class _ColumnParallel(torch.autograd.Function):
    """y_r = x @ w_r.T with x (..., K) whole on every rank and w_r (N_r, K) this rank's rows."""

    @staticmethod
    def forward(ctx, x, weight, group, block_size):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.block_size = group, block_size
        return invariant_matmul(x, weight.t(), block_size=block_size)  # over K: whole here

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, N_r)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # over N: split over the ranks, summed exactly
            grad_x = invariant_matmul(grad2, weight, group=ctx.group, block_size=ctx.block_size).view(x.shape)
        if ctx.needs_input_grad[1]:  # over the tokens: whole on every rank
            grad_w = invariant_matmul(grad2.t(), x.reshape(-1, x.shape[-1]), block_size=ctx.block_size)
        return grad_x, grad_w, None, None


class _RowParallel(torch.autograd.Function):
    """y = sum_r x_r @ w_r.T with x_r (..., K_r) and w_r (N, K_r) this rank's columns."""

    @staticmethod
    def forward(ctx, x, weight, group, block_size):
        ctx.save_for_backward(x, weight)
        ctx.block_size = block_size
        return invariant_matmul(x, weight.t(), group=group, block_size=block_size)  # over K: split

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad2 = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, N)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # over N: whole here
            grad_x = invariant_matmul(grad2, weight, block_size=ctx.block_size).view(x.shape)
        if ctx.needs_input_grad[1]:  # over the tokens: whole on every rank
            grad_w = invariant_matmul(grad2.t(), x.reshape(-1, x.shape[-1]), block_size=ctx.block_size)
        return grad_x, grad_w, None, None


def invariant_sum(x: torch.Tensor, *, group=None) -> torch.Tensor:
    """The sum of ``x`` (..., D) over every dimension but the last and over the rows of every
    rank of ``group`` (each rank an equal share: a sequence split evenly) -> (D,) fp32, the
    same bits on every rank and however the rows are split.  The int64 block fixed point of
    the data-parallel reduction (`encode`/`decode`), one block per column: the exponent from an
    exact MAX over every row, the rows' integers summed locally and by an int64 all-reduce,
    one rounding to fp32.  ``group=None``: the rows are all here."""
    if x.dtype != torch.float32:
        raise ConfigError(f"invariant_sum takes fp32, got {x.dtype}")
    world_size = 1 if group is None else group_rank_and_world_size(group)[1]
    columns = x.reshape(-1, x.shape[-1]).t().contiguous()  # (D, rows): a block per column
    bits = fraction_bits(max(1, columns.shape[1] * world_size))  # headroom for every rank's rows
    exps = block_exponents(columns)
    if world_size > 1:
        dist.all_reduce(exps, op=dist.ReduceOp.MAX, group=group)  # exact: a max of integers
    sums = encode(columns, exps, bits)[0].sum(dim=1, keepdim=True)  # int64: exact, any order
    if world_size > 1:
        dist.all_reduce(sums, group=group)
    return decode(sums, exps, bits).view(-1)


class _ScaleColumns(torch.autograd.Function):
    """y * weight over the last dimension; the weight's gradient sums over rows and ranks."""

    @staticmethod
    def forward(ctx, y, weight, group):
        ctx.save_for_backward(y, weight)
        ctx.group = group
        return y * weight

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        grad_y = grad * weight if ctx.needs_input_grad[0] else None
        grad_w = invariant_sum(grad * y, group=ctx.group) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None


def scale_columns(y: torch.Tensor, weight: torch.Tensor, group=None) -> torch.Tensor:
    """``y * weight`` (weight (D,) over y's last dimension), whose weight gradient is
    `invariant_sum` over y's rows and over ``group``'s ranks: a norm's elementwise weight
    under sequence parallelism (each rank holding some positions) gets the same gradient bits
    at every split.  Elementwise products are the same at any split; only the sum needed this."""
    return _ScaleColumns.apply(y, weight, group)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group=None, *,
                           block_size: int = TP_BLOCK_SIZE) -> torch.Tensor:
    """A linear layer (no bias) whose output features are split over ``group``: ``x`` (..., K)
    the same on every rank, ``weight`` (N_r, K) this rank's rows; returns (..., N_r).  The
    backward's input gradient sums over the split N exactly (an int64 all-reduce), so it is
    the same on every rank and at every split; every product is `invariant_matmul`'s."""
    return _ColumnParallel.apply(x, weight, group, block_size)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group=None, *,
                        block_size: int = TP_BLOCK_SIZE) -> torch.Tensor:
    """A linear layer (no bias) whose input features are split over ``group``: ``x`` (..., K_r)
    and ``weight`` (N, K_r) this rank's share (whole blocks of K); returns the full (..., N),
    the same bits on every rank and at every split (an exact int64 all-reduce)."""
    return _RowParallel.apply(x, weight, group, block_size)


__all__ = ["TP_BLOCK_SIZE", "invariant_matmul", "column_parallel_linear", "row_parallel_linear", "invariant_sum",
           "scale_columns"]
