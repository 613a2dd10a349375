"""Triton kernels of the MoE combine (unpermute) and its backward.

out[t] = sum_k prob[t, k] * expert_out[slot_index[t, k]].  Two forward variants:

- "atomic": one program per (expert-output row, H-block) scatters prob * row into
  out[token] with `tl.atomic_add` on an fp32 buffer; the K rows of a token arrive in
  whatever order their programs run, so the fp32 sum changes from run to run on a GPU.
- "deterministic": one program per (token, H-block) gathers its K rows and adds them in
  k order 0..K-1.  Each output element is a fixed sequence of fp32 operations, so the bits
  do not depend on BLOCK_H or on scheduling.

The backward is a gather (no reduction across programs) and is shared by both variants.
Imported lazily by `samebits.kernels._combine` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_gather_kernel(
    eo_ptr, prob_ptr, slot_ptr, out_ptr, H, top_k, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in range(0, top_k):  # fixed order: k = 0, 1, ..., K-1
        slot = tl.load(slot_ptr + token * top_k + k).to(tl.int64)
        p = tl.load(prob_ptr + token * top_k + k).to(tl.float32)
        row = tl.load(eo_ptr + slot * H + cols, mask=mask, other=0.0).to(tl.float32)
        acc += p * row
    tl.store(out_ptr + token * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_scatter_kernel(
    eo_ptr, row_token_ptr, row_prob_ptr, acc_ptr, H, BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token = tl.load(row_token_ptr + row)
    if token < 0:  # padding row that no token reads
        return
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    p = tl.load(row_prob_ptr + row).to(tl.float32)
    x = tl.load(eo_ptr + row * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(acc_ptr + token * H + cols, p * x, mask=mask, sem="relaxed")  # arrival order


@triton.jit
def _combine_backward_kernel(
    eo_ptr, prob_ptr, slot_ptr, dout_ptr, d_eo_ptr, d_prob_ptr, H, top_k,
    K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """Per token: d_eo[slot[t, k]] = prob[t, k] * dout[t] (plain stores: each slot has one
    owner) and d_prob[t, k] = sum_h dout[t, h] * eo[slot[t, k], h] in H-block order."""
    token = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_PAD)
    mask_k = ks < top_k
    slots = tl.load(slot_ptr + token * top_k + ks, mask=mask_k, other=0).to(tl.int64)
    p = tl.load(prob_ptr + token * top_k + ks, mask=mask_k, other=0.0).to(tl.float32)
    acc = tl.zeros((K_PAD,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask_h = cols < H
        mask = mask_k[:, None] & mask_h[None, :]
        g = tl.load(dout_ptr + token * H + cols, mask=mask_h, other=0.0).to(tl.float32)
        rows = tl.load(eo_ptr + slots[:, None] * H + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)  # (K_PAD, BLOCK_H)
        acc += tl.sum(rows * g[None, :], axis=1)
        tl.store(d_eo_ptr + slots[:, None] * H + cols[None, :],
                 (p[:, None] * g[None, :]).to(d_eo_ptr.dtype.element_ty), mask=mask)
    tl.store(d_prob_ptr + token * top_k + ks, acc.to(d_prob_ptr.dtype.element_ty), mask=mask_k)


def _num_warps(block_h: int) -> int:
    return 4 if block_h <= 1024 else 8


def combine(
    expert_out: torch.Tensor,  # (R, H) contiguous
    prob: torch.Tensor,  # (T, K) contiguous
    slot_index: torch.Tensor,  # (T, K) contiguous integer
    variant: str,  # "deterministic" | "atomic"
    block_h: int,
) -> torch.Tensor:  # (T, H) in expert_out.dtype
    num_rows, hidden = expert_out.shape
    num_tokens, top_k = slot_index.shape
    out_dtype = expert_out.dtype
    grid_h = triton.cdiv(hidden, block_h)
    if variant == "deterministic":
        out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=expert_out.device)
        if num_tokens and hidden:
            _combine_gather_kernel[(num_tokens, grid_h)](
                expert_out, prob, slot_index, out, hidden, top_k,
                BLOCK_H=block_h, num_warps=_num_warps(block_h),
            )
        return out
    # Atomic scatter: invert the routing (row -> token, prob).  index_put_ without
    # accumulation and with distinct indices is deterministic.
    flat_slots = slot_index.reshape(-1).to(torch.int64)  # (T*K,)
    row_token = torch.full((num_rows,), -1, dtype=torch.int64, device=expert_out.device)
    row_token[flat_slots] = torch.arange(
        num_tokens, device=expert_out.device).repeat_interleave(top_k)
    row_prob = torch.zeros((num_rows,), dtype=torch.float32, device=expert_out.device)
    row_prob[flat_slots] = prob.reshape(-1).to(torch.float32)
    acc = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=expert_out.device)
    if num_rows and hidden:
        _combine_scatter_kernel[(num_rows, grid_h)](
            expert_out, row_token, row_prob, acc, hidden,
            BLOCK_H=block_h, num_warps=_num_warps(block_h),
        )
    return acc.to(out_dtype)


def combine_backward(
    expert_out: torch.Tensor,  # (R, H)
    prob: torch.Tensor,  # (T, K)
    slot_index: torch.Tensor,  # (T, K)
    dout: torch.Tensor,  # (T, H) contiguous
    block_h: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # d_expert_out (R, H), d_prob (T, K)
    num_tokens, top_k = slot_index.shape
    hidden = expert_out.shape[1]
    # Rows no token reads (padding) get a zero gradient.
    d_eo = torch.zeros_like(expert_out)
    d_prob = torch.empty((num_tokens, top_k), dtype=prob.dtype, device=prob.device)
    if num_tokens:
        _combine_backward_kernel[(num_tokens,)](
            expert_out, prob, slot_index, dout, d_eo, d_prob, hidden, top_k,
            K_PAD=triton.next_power_of_2(top_k), BLOCK_H=block_h,
            num_warps=_num_warps(block_h),
        )
    return d_eo, d_prob
