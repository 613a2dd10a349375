"""Triton kernel of the digest body: one pass over the bytes, a wrapping uint64 sum.

Stage 1: each program reads WORDS_PER_PROGRAM consecutive 8-byte words (as int64 loads when
the data pointer is 8-byte aligned, as bytes otherwise), mixes each word with mix2, keeps a
per-lane wrapping sum across its loop and writes one partial.  The last, partial word (< 8
bytes) is read with masked byte loads.  Stage 2: one program adds the partials in index
order.  Wrapping addition is associative and commutative, so the result is the same for
every block size and launch shape; the two stages are kept for speed (no atomics contention)
and for the same structure as the other kernels.

Imported lazily by `samebits.kernels._digest` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_WORDS = 1024  # words per inner step: 8 per thread at 4 warps (64 B, 4 x 16 B loads)
STEPS_PER_PROGRAM = 8  # 64 KiB per program; 16384 programs for 1 GiB
PARTIAL_BLOCK = 1024


@triton.jit
def _mix_round(x, key):
    x ^= (x & 0xFFFFFFFF) * key  # a 32x32->64 multiply of the low half (uint64)
    return (x >> 32) | (x << 32)  # swap the halves


@triton.jit
def _mix2(x):
    """Digest version 2's word mixer (docs/digest.md, step 3); keys as in fingerprint._spec."""
    x = _mix_round(x, 0x9E3779B8)
    x = _mix_round(x, 0x85EBCA6A)
    x = _mix_round(x, 0xC2B2AE34)
    x = _mix_round(x, 0x27D4EB2E)
    return _mix_round(x, 0x165667B0)


@triton.jit
def _digest_body_kernel(
    byte_ptr, word_ptr, partial_ptr, num_bytes, num_full_words, num_words,
    WORD_ALIGNED: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    # Sizes may arrive as int32 (or constexpr 1); widen so that `* 8` cannot overflow > 2 GiB.
    num_bytes = tl.cast(num_bytes, tl.int64)
    num_full_words = tl.cast(num_full_words, tl.int64)
    num_words = tl.cast(num_words, tl.int64)
    lanes = tl.arange(0, BLOCK)
    # (j + 1) * GOLDEN = (base + 1) * GOLDEN + lane * GOLDEN: the per-lane product is hoisted
    # out of the loop, leaving one 64-bit multiply per step for the scalar part.
    lane_key = lanes.to(tl.uint64) * 0x9E3779B97F4A7C15
    acc = tl.zeros((BLOCK,), dtype=tl.uint64)
    for step in tl.static_range(STEPS):
        base = (pid * STEPS + step) * BLOCK
        j = base + lanes  # (BLOCK,) int64 word index
        if WORD_ALIGNED:  # whole words here; the tail word is added below
            valid = j < num_full_words
            w = tl.load(word_ptr + j, mask=valid, other=0).to(tl.uint64, bitcast=True)
        else:
            valid = j < num_words
            offsets = j[:, None] * 8 + tl.arange(0, 8)[None, :]  # (BLOCK, 8) byte offsets
            b = tl.load(byte_ptr + offsets, mask=offsets < num_bytes, other=0).to(tl.uint64)
            w = tl.sum(b << (tl.arange(0, 8)[None, :].to(tl.uint64) * 8), axis=1)
        key = (base + 1).to(tl.uint64) * 0x9E3779B97F4A7C15 + lane_key
        h = _mix2(w + key)
        acc += tl.where(valid, h, 0)
    if WORD_ALIGNED:
        # The zero-padded last word, if the length is not a multiple of 8 (masked byte loads).
        first = pid * STEPS * BLOCK
        last = first + STEPS * BLOCK
        pos = num_full_words * 8 + tl.arange(0, 8)  # (8,) byte offsets of the last word
        in_tail = (pos < num_bytes) & (pos >= first * 8) & (pos < last * 8)
        b = tl.load(byte_ptr + pos, mask=in_tail, other=0).to(tl.uint64)
        w = tl.sum(b << (tl.arange(0, 8).to(tl.uint64) * 8), axis=0)
        h = _mix2(w + (num_full_words + 1).to(tl.uint64) * 0x9E3779B97F4A7C15)
        tail_j = num_full_words + lanes * 0  # (BLOCK,) the tail word's index, on lane 0 only
        owns_tail = (lanes == 0) & (tail_j < num_words) & (tail_j >= first) & (tail_j < last)
        acc += tl.where(owns_tail, h, 0)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, num_partials, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.uint64)
    for start in range(0, num_partials, BLOCK):
        i = start + tl.arange(0, BLOCK)
        acc += tl.load(partial_ptr + i, mask=i < num_partials, other=0).to(tl.uint64, bitcast=True)
    tl.store(out_ptr, tl.sum(acc, axis=0).to(tl.int64, bitcast=True))


def digest_body(data: torch.Tensor) -> torch.Tensor:
    """data: (L,) contiguous uint8 -> 0-dim int64 body sum on data.device."""
    num_bytes = data.numel()
    num_full_words = num_bytes // 8
    num_words = triton.cdiv(num_bytes, 8)
    out = torch.zeros((), dtype=torch.int64, device=data.device)
    if num_words == 0:
        return out
    # Word loads need an 8-byte aligned start (and at least one whole word to view).
    aligned = num_full_words > 0 and data.data_ptr() % 8 == 0 and data.storage_offset() % 8 == 0
    words = data[: num_full_words * 8].view(torch.int64) if aligned else data  # (L // 8,)
    words_per_program = BLOCK_WORDS * STEPS_PER_PROGRAM
    num_programs = triton.cdiv(num_words, words_per_program)
    partials = torch.empty(num_programs, dtype=torch.int64, device=data.device)
    _digest_body_kernel[(num_programs,)](
        data, words, partials, num_bytes, num_full_words, num_words,
        WORD_ALIGNED=aligned, BLOCK=BLOCK_WORDS, STEPS=STEPS_PER_PROGRAM, num_warps=4,
    )
    _sum_partials_kernel[(1,)](partials, out, num_programs, BLOCK=PARTIAL_BLOCK)
    return out
