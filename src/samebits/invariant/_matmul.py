"""Matrix products with the same bits however their reduction dimension is split over ranks:
the tensor-parallel linear layers of docs/invariance.md.

    tree_matmul(a, b, group=None)             a (..., K_r) @ b (K_r, N): platform GEMM leaves, one fixed tree
    gemm_matmul(a, b)                         a (M, K) @ b (K, N), K whole: bits of the row and column only
    invariant_matmul(a, b, group=None)        the same contract as tree_matmul, exact block products
    invariant_sum(x, group=None)              x (..., D) summed over its rows and every rank's rows
    scale_columns(y, weight, group=None)      y * weight; the weight gradient is an invariant_sum (SP norms)
    gather_columns(x, group=None)             the ranks' column blocks joined (an LM head's logits, loss whole)
    column_parallel_linear(x, w_shard, group, mode="gemm")     y_r = x @ w_r.T (N split; backward sums over N)
    row_parallel_linear(x_shard, w_shard, group, mode="gemm")  y = sum_r x_r @ w_r.T (K split)

**mode "gemm" (the default, issue 37): platform fp32 GEMMs.**  Measured on this CPU (MKL,
benchmarks/gemm_block_bits.py): one fp32 GEMM computes element (m, n) from row m and column n
alone, with the same bits at any M, N, offset or stride, when it runs on one thread with
M >= 4 and N >= 12; below those (and when MKL's threads cut M or N into tiles that small) it
takes other kernels with other bits.  `gemm_matmul` pads M and N and holds one intra-op
thread, so a product whose K is whole on every rank (the column layer's forward, every
weight gradient, the row layer's input gradient) has the same bits at any TP degree.  A
product whose K the ranks split (the row layer's forward, the column layer's input
gradient) is `tree_matmul`: K is cut into L = gcd(K / 32, 8) canonical leaves, each one
such GEMM, added in fp32 by one binary tree over the leaf indices; at TP degree W (a power of
two dividing L) each rank's contiguous share is a whole subtree, the W subtree sums are
all-gathered (fp32, M x N each) and every rank adds them by the tree's upper levels.  The
tree is the same at every W, so the bits are.  Accuracy: an fp32 GEMM's (each leaf an fp32
sum over K / L, then log2 L fp32 additions); nan and inf propagate as in any fp32 GEMM.

**mode "exact": exact block products.**  `invariant_matmul` cuts K into canonical blocks of
``TP_BLOCK_SIZE`` (32) and puts each operand in block fixed point: within a block of ``a``'s
row m (of ``b``'s column n), every element becomes an integer of at most 24 bits times one
power of two, the block's (``e``: the smallest with ``|x| < 2**e``).  A block's product is a
sum of 32 products of two such integers, ``|sum| <= 32 * 2**48 = 2**53``: exact in fp64 in any
order, whatever kernel, M, N or thread count.  The block products are added in int64 fixed
point at a quantum fixed by the whole row's and column's exponents (an exact MAX all-reduce
of M + N integers), locally and over the ranks (an int64 all-reduce), and rounded to fp32
once.  It needs no measurement of the platform GEMM (any kernel, any CPU or GPU) and is
within 1 ulp of the fp64 product for most elements, at about 20x the time of a plain linear
on one CPU thread.  Each element loses the bits below 2**(e - 24) of its block's exponent;
the sum truncates only what lies below 2**-62 of the row and column bound, and rounds once.
A row or column holding inf or nan gives nan, and results in fp32's subnormal range may be
rounded twice (still the same at every split).
"""

from __future__ import annotations

import contextlib
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


def _check(a: torch.Tensor, b: torch.Tensor, world_size: int, block_size: int, *, exact: bool = True) -> None:
    name = "invariant_matmul" if exact else "tree_matmul"
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        raise ConfigError(f"{name} takes fp32 operands, got {a.dtype} @ {b.dtype}: keep the "
                          "layer in fp32 (tp_reduce=invariant runs with precision=fp32)")
    if b.dim() != 2 or a.dim() < 1 or a.shape[-1] != b.shape[0]:
        raise ConfigError(f"{name}: cannot multiply {tuple(a.shape)} by {tuple(b.shape)} "
                          "(a (..., K) @ b (K, N))")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 \
            or (exact and 2 * _OPERAND_BITS + math.ceil(math.log2(block_size)) > 53):
        raise ConfigError(f"block_size={block_size!r}: must be a positive int of at most 32 (a block's sum of "
                          "24-bit products must stay exact in fp64)")
    if world_size > 1 and a.shape[-1] % block_size:
        raise ConfigError(
            f"{name}: the reduction dimension is split over {world_size} ranks into "
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


# --- the default mode: platform fp32 GEMM leaves, one fixed tree (issue 37) -------------------

_MIN_ROWS = 8  # measured: M >= 4 rows and N >= 12 columns are computed by one kernel whose
_MIN_COLS = 16  # element bits depend on the row and column only (benchmarks/gemm_block_bits.py)
MAX_LEAVES = 8  # the most leaves a product over a split K is cut into (TP degrees 1, 2, 4, 8)
TP_MATMUL_MODES = ("gemm", "exact")


@contextlib.contextmanager
def _one_thread():
    """The GEMMs inside run on one intra-op thread: measured, MKL splits M and N over its
    threads, and a thread's tile below 4 rows or 12 columns takes another kernel (other bits),
    so the bits of an element would depend on the thread count and the shape around it."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _padded(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a (..., M, K) and b (..., K, N) with M and N zero-padded up to _MIN_ROWS, _MIN_COLS."""
    pad_m, pad_n = max(0, _MIN_ROWS - a.shape[-2]), max(0, _MIN_COLS - b.shape[-1])
    if pad_m:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad_m))
    if pad_n:
        b = torch.nn.functional.pad(b, (0, pad_n))
    return a, b


def gemm_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a (M, K) @ b (K, N)`` by the platform's fp32 GEMM, whole K, with element (m, n)'s bits
    a function of row m of ``a`` and column n of ``b`` only, not of M, N, the operands' offsets
    or strides, or the thread count: one thread, M and N padded to the shapes measured to take
    one kernel (benchmarks/gemm_block_bits.py).  The products whose K is whole on every rank."""
    m, n = a.shape[0], b.shape[1]
    a, b = _padded(a, b)
    with _one_thread():
        return torch.mm(a, b)[:m, :n]


def _pairwise(parts: torch.Tensor) -> torch.Tensor:
    """parts (L, M, N), L a power of two -> their sum by the binary tree over adjacent pairs:
    leaves 2i and 2i+1 first, and so on up; a rank's contiguous share is a whole subtree."""
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def _num_leaves(k_total: int, block_size: int) -> int:
    """Leaves of a product over K: gcd(K / block_size, MAX_LEAVES), a power of two fixed by
    the full K alone (never by the split), each leaf K / leaves consecutive elements."""
    return math.gcd(k_total // block_size, MAX_LEAVES) if k_total else 1


def tree_matmul(a: torch.Tensor, b: torch.Tensor, *, group=None, block_size: int = TP_BLOCK_SIZE) -> torch.Tensor:
    """``a (..., K_r) @ b (K_r, N)`` summed over the ranks of ``group`` -> (..., N) fp32, the
    same bits on every rank and however the full K is split, without exact products: K is cut
    into L = gcd(K / block_size, 8) canonical leaves; each leaf [M, K/L] x [K/L, N] is one
    platform fp32 GEMM (`gemm_matmul`'s conditions: its bits are the leaf's alone); the leaves
    are added in fp32 by one binary tree over the leaf indices.  A rank holding K/W of K (W a
    power of two dividing L) computes its whole subtree; the W subtree sums are all-gathered
    and every rank adds them by the tree's upper levels.  ``group=None``: K whole here."""
    world_size = 1 if group is None else group_rank_and_world_size(group)[1]
    _check(a, b, world_size, block_size, exact=False)
    lead, k_local, n = a.shape[:-1], a.shape[-1], b.shape[1]
    a2 = a.reshape(-1, k_local)
    m = a2.shape[0]
    pad = (-k_local) % block_size  # only without a split (checked)
    if pad:
        a2 = torch.nn.functional.pad(a2, (0, pad))
        b = torch.nn.functional.pad(b, (0, 0, 0, pad))
    k_total = (k_local + pad) * world_size
    leaves = _num_leaves(k_total, block_size)
    if leaves % world_size:
        raise ConfigError(
            f"tree_matmul: the reduction dimension of {k_total} elements is cut into {leaves} leaves, "
            f"which {world_size} ranks cannot share as whole subtrees (the TP degree must be a power of "
            f"two dividing {leaves}); change the layer sizes or the TP degree, or use mode='exact'")
    local = leaves // world_size
    width = (k_local + pad) // local if local else 0
    a_leaves, b_leaves = _padded(a2.view(m, local, width).transpose(0, 1), b.reshape(local, width, n))
    with _one_thread():
        partial = _pairwise(torch.bmm(a_leaves, b_leaves))[:m, :n]  # (M, N)
    if world_size > 1:
        parts = [torch.empty_like(partial) for _ in range(world_size)]
        dist.all_gather(parts, partial.contiguous(), group=group)  # rank order = leaf order
        partial = _pairwise(torch.stack(parts))
    return partial.reshape(*lead, n)


def _products(mode: str):
    """(whole-K product, split-K product) of a TP linear in ``mode``."""
    if mode == "gemm":
        return (lambda a, b, block_size: gemm_matmul(a, b)), tree_matmul
    return (lambda a, b, block_size: invariant_matmul(a, b, block_size=block_size)), invariant_matmul


class _ColumnParallel(torch.autograd.Function):
    """y_r = x @ w_r.T with x (..., K) whole on every rank and w_r (N_r, K) this rank's rows."""

    @staticmethod
    def forward(ctx, x, weight, group, block_size, mode):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.block_size, ctx.mode = group, block_size, mode
        whole, _ = _products(mode)
        out = whole(x.reshape(-1, x.shape[-1]), weight.t(), block_size)  # over K: whole here
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole, split = _products(ctx.mode)
        grad2 = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, N_r)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # over N: split over the ranks
            grad_x = split(grad2, weight, group=ctx.group, block_size=ctx.block_size).view(x.shape)
        if ctx.needs_input_grad[1]:  # over the tokens: whole on every rank
            grad_w = whole(grad2.t(), x.reshape(-1, x.shape[-1]), ctx.block_size)
        return grad_x, grad_w, None, None, None


class _RowParallel(torch.autograd.Function):
    """y = sum_r x_r @ w_r.T with x_r (..., K_r) and w_r (N, K_r) this rank's columns."""

    @staticmethod
    def forward(ctx, x, weight, group, block_size, mode):
        ctx.save_for_backward(x, weight)
        ctx.block_size, ctx.mode = block_size, mode
        _, split = _products(mode)
        return split(x, weight.t(), group=group, block_size=block_size)  # over K: split

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole, _ = _products(ctx.mode)
        grad2 = grad.reshape(-1, grad.shape[-1]).contiguous()  # (M, N)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # over N: whole here
            grad_x = whole(grad2, weight, ctx.block_size).view(x.shape)
        if ctx.needs_input_grad[1]:  # over the tokens: whole on every rank
            grad_w = whole(grad2.t(), x.reshape(-1, x.shape[-1]), ctx.block_size)
        return grad_x, grad_w, None, None, None


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


class _GatherColumns(torch.autograd.Function):
    """Every rank's column block joined along the last dimension, in rank order (exact)."""

    @staticmethod
    def forward(ctx, x, group):
        rank, world_size = group_rank_and_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.block = (rank * x.shape[-1], (rank + 1) * x.shape[-1])
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start, end = ctx.block
        return grad[..., start:end].contiguous(), None


def gather_columns(x: torch.Tensor, group=None) -> torch.Tensor:
    """``x`` (..., N_r), this rank's block of the columns (a column-parallel layer's output), joined
    with every rank's of ``group`` into (..., N), the same bits on every rank.  The gradient of
    a rank's block is its block of the output's gradient: for what every rank then computes
    whole and alike (an LM head's logits, the loss computed from all of them rather than by
    loss-parallel partial sums).  ``group=None``: ``x`` is every column."""
    return x if group is None else _GatherColumns.apply(x, group)


def _check_mode(mode: str) -> None:
    if mode not in TP_MATMUL_MODES:
        raise ConfigError(f"mode={mode!r}: the TP-invariant linears take one of {', '.join(TP_MATMUL_MODES)} "
                          "('gemm': platform GEMM leaves in a fixed tree; 'exact': exact block products)")


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group=None, *,
                           block_size: int = TP_BLOCK_SIZE, mode: str = "gemm") -> torch.Tensor:
    """A linear layer (no bias) whose output features are split over ``group``: ``x`` (..., K)
    the same on every rank, ``weight`` (N_r, K) this rank's rows; returns (..., N_r).  The
    backward's input gradient sums over the split N, the same on every rank and at every
    split.  ``mode`` "gemm": products over a whole K by `gemm_matmul`, over the split N by
    `tree_matmul`; "exact": every product `invariant_matmul`'s (exact block products)."""
    _check_mode(mode)
    return _ColumnParallel.apply(x, weight, group, block_size, mode)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group=None, *,
                        block_size: int = TP_BLOCK_SIZE, mode: str = "gemm") -> torch.Tensor:
    """A linear layer (no bias) whose input features are split over ``group``: ``x`` (..., K_r)
    and ``weight`` (N, K_r) this rank's share (whole blocks of K); returns the full (..., N),
    the same bits on every rank and at every split (``mode`` as `column_parallel_linear`'s:
    the forward by `tree_matmul`, or `invariant_matmul` under "exact")."""
    _check_mode(mode)
    return _RowParallel.apply(x, weight, group, block_size, mode)


__all__ = ["TP_BLOCK_SIZE", "TP_MATMUL_MODES", "MAX_LEAVES", "invariant_matmul", "tree_matmul", "gemm_matmul",
           "column_parallel_linear", "row_parallel_linear", "gather_columns", "invariant_sum", "scale_columns"]
