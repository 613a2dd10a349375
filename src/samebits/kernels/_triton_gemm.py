"""Triton kernels of the grouped GEMM with a router-probability (dprob) epilogue.

Rows are sorted by expert.  One program computes one (BLOCK_M rows of one expert) x
(BLOCK_N columns) tile.  The tile schedule maps program ids to (expert, first row) on the
device, without a host sync.  The dprob epilogue reduces `dY * Y` over the tile's columns;
the two variants differ only in where that per-(row, N-tile) partial goes:

- "atomic": `tl.atomic_add` into `dprob[row]`; the N-tiles of a row add in arrival order,
  which on a GPU changes from run to run, and fp32 addition is not associative.
- "deterministic": a private slot `partial[pid_n, row]`, then a second tiny kernel adds the
  slots of each row in slot order 0, 1, 2, ...  Same tiles, same parallelism, fixed order.

Imported lazily by `samebits.kernels._gemm` (this module imports triton).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from samebits.kernels._backend import interpret_mode

DPROB_NONE, DPROB_ATOMIC, DPROB_SLOTS = 0, 1, 2


@dataclass(frozen=True)
class TileSchedule:
    """Program-id -> (expert, first row) map for a BLOCK_M tiling of expert-sorted rows."""

    tile_expert: torch.Tensor  # (num_tiles_max,) int32; == num_experts for unused programs
    tile_row: torch.Tensor  # (num_tiles_max,) int64 first row of the tile
    expert_start: torch.Tensor  # (E,) int64 first row of each expert
    expert_end: torch.Tensor  # (E,) int64 one past the last row of each expert
    num_rows: int
    block_m: int


def make_schedule(tokens_per_expert: torch.Tensor, num_rows: int, block_m: int) -> TileSchedule:
    """Build the tile schedule with device-side torch ops (no `.item()`, no host sync)."""
    counts = tokens_per_expert.to(torch.int64)  # (E,)
    num_experts = counts.numel()
    expert_end = torch.cumsum(counts, 0)  # (E,)
    expert_start = expert_end - counts
    tiles = (counts + block_m - 1) // block_m  # (E,)
    tile_end = torch.cumsum(tiles, 0)  # (E,)
    # sum_e ceil(c_e / B) <= ceil(sum_e c_e / B) + E: a static bound on the number of tiles.
    num_tiles_max = triton.cdiv(num_rows, block_m) + num_experts
    ids = torch.arange(num_tiles_max, device=counts.device)
    tile_expert = torch.searchsorted(tile_end, ids, right=True)  # (num_tiles_max,) in [0, E]
    expert = tile_expert.clamp(max=num_experts - 1)
    tile_row = expert_start[expert] + (ids - (tile_end[expert] - tiles[expert])) * block_m
    return TileSchedule(
        tile_expert.to(torch.int32), tile_row, expert_start, expert_end, num_rows, block_m
    )


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, scale_ptr, dc_ptr, dprob_ptr,
    tile_expert_ptr, tile_row_ptr, expert_end_ptr,
    num_rows, num_experts, N, K,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn, stride_dcm, stride_dcn,
    HAS_SCALE: tl.constexpr, WRITE_C: tl.constexpr, DPROB_MODE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """C[rows] = scale[rows] * (A[rows] @ B[e]) for the rows of one expert tile; optionally the
    dprob epilogue sum_n dC * (A @ B[e]) per row (atomic, or into slot pid_n)."""
    # N-tiles vary fastest: programs running together share the A rows (read from HBM once)
    # and the expert's weights (small enough for L2).
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert >= num_experts:  # past the last real tile: the grid is a static upper bound
        return
    row_start = tl.load(tile_row_ptr + pid_m)
    row_end = tl.minimum(tl.load(expert_end_ptr + expert), num_rows)
    rows = row_start + tl.arange(0, BLOCK_M)  # (BM,) int64
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    mask_m = rows < row_end
    mask_n = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak  # (BM, BK)
    b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be
              + ks[:, None] * stride_bk + cols[None, :] * stride_bn)  # (BK, BN)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = ks < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if DOT_UPCAST:  # interpreter only: its tl.dot reads bf16 as raw uint16 bits
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if DPROB_MODE != 0:
        dc = tl.load(dc_ptr + rows[:, None] * stride_dcm + cols[None, :] * stride_dcn,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        partial = tl.sum(acc * dc, axis=1)  # (BM,) this N-tile's share of dprob
        if DPROB_MODE == 1:
            # Arrival order.  Relaxed: the cheapest atomic, so the comparison is fair to it.
            tl.atomic_add(dprob_ptr + rows, partial, mask=mask_m, sem="relaxed")
        else:
            # Own slot; slot-major (num_slots, T) so the BM rows are one coalesced store.
            tl.store(dprob_ptr + pid_n.to(tl.int64) * num_rows + rows, partial, mask=mask_m)
    if WRITE_C:
        if HAS_SCALE:
            scale = tl.load(scale_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
            acc = acc * scale[:, None]
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
                 acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _sum_slots_kernel(partial_ptr, out_ptr, num_rows, num_slots, BLOCK: tl.constexpr):
    """out[row] = ((partial[0, row] + partial[1, row]) + partial[2, row]) + ...: slot order."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    slot_ptrs = partial_ptr + rows  # slot 0; each step moves one slot (num_rows) on
    for _ in range(0, num_slots):
        acc += tl.load(slot_ptrs, mask=mask, other=0.0)
        slot_ptrs += num_rows
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, prob_ptr, dw_ptr, expert_start_ptr, expert_end_ptr,
    num_rows, K, N,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_we, stride_wk, stride_wn,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dW[e] = X_e^T @ (prob_e * dY_e): one program per (K-tile, N-tile, expert), looping over
    the expert's rows in order, so no cross-program reduction and no atomics."""
    pid_k = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.program_id(2)
    row_start = tl.load(expert_start_ptr + expert)
    row_end = tl.minimum(tl.load(expert_end_ptr + expert), num_rows)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_k = ks < K
    mask_n = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        mask_m = rows < row_end
        xt = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                     mask=mask_k[:, None] & mask_m[None, :], other=0.0)  # (BK, BM) = X^T tile
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :] * stride_dyn,
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        prob = tl.load(prob_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        # Round prob * dY to the input dtype as autograd of the reference does.
        dyu = (dy * prob[:, None]).to(x_ptr.dtype.element_ty)  # (BM, BN)
        if DOT_UPCAST:  # interpreter only, as above
            acc = tl.dot(xt.to(tl.float32), dyu.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(xt, dyu, acc, input_precision=DOT_PRECISION)
    tl.store(dw_ptr + expert.to(tl.int64) * stride_we + ks[:, None] * stride_wk
             + cols[None, :] * stride_wn, acc.to(dw_ptr.dtype.element_ty),
             mask=mask_k[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one grouped-GEMM launch.  The dprob bits depend on block_n (it decides the
    partition into slots) and on block_k (the order of the K sum); keep them fixed to compare."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64

    @property
    def num_warps(self) -> int:
        return 8 if self.block_m * self.block_n >= 128 * 128 else 4


def _dot_options(dtype: torch.dtype) -> dict:
    # fp32 inputs: full-precision products as torch.matmul does by default (no TF32).
    # Under TRITON_INTERPRET, tl.dot multiplies bf16 operands as their raw uint16 bits
    # (triton 3.9): upcast them to fp32 there, which is exact (bf16 products fit in fp32).
    upcast = interpret_mode() and dtype == torch.bfloat16
    precision = "ieee" if dtype == torch.float32 or upcast else None
    return {"DOT_PRECISION": precision, "DOT_UPCAST": upcast}


def grouped_gemm(
    a: torch.Tensor,  # (T, K) rows sorted by expert
    b: torch.Tensor,  # (E, K, N), any strides (a transposed view works)
    schedule: TileSchedule,
    scale: torch.Tensor | None,  # (T,) per-row factor applied in the epilogue, or None
    tiles: Tiles,
) -> torch.Tensor:  # (T, N) in a.dtype
    num_rows, k = a.shape
    num_experts, _, n = b.shape
    c = torch.empty((num_rows, n), dtype=a.dtype, device=a.device)
    grid = (schedule.tile_expert.numel() * triton.cdiv(n, tiles.block_n),)
    _grouped_gemm_kernel[grid](
        a, b, c, scale if scale is not None else a, a, a,
        schedule.tile_expert, schedule.tile_row, schedule.expert_end,
        num_rows, num_experts, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        c.stride(0), c.stride(1), 0, 0,
        HAS_SCALE=scale is not None, WRITE_C=True, DPROB_MODE=DPROB_NONE,
        **_dot_options(a.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=3,
    )
    return c


def grouped_dprob(
    x: torch.Tensor,  # (T, K)
    w: torch.Tensor,  # (E, K, N)
    schedule: TileSchedule,
    dy: torch.Tensor,  # (T, N) gradient of prob[:, None] * (x @ w_e)
    variant: str,  # "deterministic" | "atomic"
    tiles: Tiles,
    out_dtype: torch.dtype,
) -> torch.Tensor:  # (T,) dprob[t] = sum_n dy[t, n] * (x @ w_e)[t, n]
    """Recompute Y = x @ w_e tile by tile and reduce dY * Y in the epilogue (Y is not stored)."""
    num_rows, k = x.shape
    num_experts, _, n = w.shape
    num_slots = triton.cdiv(n, tiles.block_n)
    if variant == "atomic":
        target = torch.zeros(num_rows, dtype=torch.float32, device=x.device)  # (T,)
        mode = DPROB_ATOMIC
    else:
        # Every (slot, row) is written by exactly one program: no zero-fill needed.
        target = torch.empty((num_slots, num_rows), dtype=torch.float32, device=x.device)
        mode = DPROB_SLOTS
    grid = (schedule.tile_expert.numel() * num_slots,)
    _grouped_gemm_kernel[grid](
        x, w, x, x, dy, target,
        schedule.tile_expert, schedule.tile_row, schedule.expert_end,
        num_rows, num_experts, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2),
        0, 0, dy.stride(0), dy.stride(1),
        HAS_SCALE=False, WRITE_C=False, DPROB_MODE=mode,
        **_dot_options(x.dtype),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=3,
    )
    if variant == "atomic":
        return target.to(out_dtype)
    dprob = torch.empty(num_rows, dtype=out_dtype, device=x.device)
    block = 1024
    _sum_slots_kernel[(triton.cdiv(num_rows, block),)](
        target, dprob, num_rows, num_slots, BLOCK=block
    )
    return dprob


def grouped_wgrad(
    x: torch.Tensor,  # (T, K)
    dy: torch.Tensor,  # (T, N)
    prob: torch.Tensor,  # (T,)
    schedule: TileSchedule,
    weight_dtype: torch.dtype,
    tiles: Tiles,
) -> torch.Tensor:  # (E, K, N) dW[e] = x_e^T @ (prob_e * dy_e)
    num_rows, k = x.shape
    n = dy.shape[1]
    num_experts = schedule.expert_start.numel()
    dw = torch.empty((num_experts, k, n), dtype=weight_dtype, device=x.device)
    # The reduction runs over tokens: reuse block_k as the K-tile and block_m as the token step.
    grid = (triton.cdiv(k, tiles.block_k), triton.cdiv(n, tiles.block_n), num_experts)
    _grouped_wgrad_kernel[grid](
        x, dy, prob, dw, schedule.expert_start, schedule.expert_end,
        num_rows, k, n,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
        dw.stride(0), dw.stride(1), dw.stride(2),
        **_dot_options(x.dtype),
        BLOCK_M=max(16, min(tiles.block_m, 64)), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps, num_stages=3,
    )
    return dw
