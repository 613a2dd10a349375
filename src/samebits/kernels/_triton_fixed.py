"""Triton kernels of the invariant reduction's block fixed point (samebits.invariant._fixed is
the definition; every bit and the inexact count must match it).

encode_sum: each program takes BLOCK consecutive elements of a (num_blocks, block_size) fp32
buffer, reads each element's block exponent, encodes it (the fp32 path, the float64 path of
tiny blocks, zeros for non-finite blocks) and writes or adds the int64 result; one launch per
micro-batch (the first writes, the others add: int64, exact in any order).  The inexact count
is kept per program and summed by torch (integers: the same in any order).  decode: the
reverse, elementwise, with the integer rounding to the subnormal grid.

Rounding half to even uses the fp32 (float64) magic number: for |s| < 2**23 (2**52),
(s + c) - c with c = copysign(2**23, s) rounds s to an integer in the one addition; larger
values are integers already.  No libdevice call, so the interpreter (TRITON_INTERPRET=1, the
tests) runs the same code as a GPU.

Imported lazily by `samebits.kernels._fixed` (this module imports triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _round_half_even_f32(s):
    c = tl.where(s < 0, -8388608.0, 8388608.0)
    return tl.where(tl.abs(s) < 8388608.0, (s + c) - c, s)


@triton.jit
def _round_half_even_f64(s):
    c = tl.where(s < 0, -4503599627370496.0, 4503599627370496.0).to(tl.float64)
    return tl.where(tl.abs(s) < 4503599627370496.0, (s + c) - c, s)


@triton.jit
def _encode_kernel(x_ptr, exp_ptr, out_ptr, count_ptr, numel, block_size, bits, ADD: tl.constexpr,
                   BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    valid = i < numel
    x = tl.load(x_ptr + i, mask=valid, other=0.0)
    e = tl.load(exp_ptr + i // block_size, mask=valid, other=0).to(tl.int32)
    shift = bits - tl.minimum(e, 126)
    scale = ((tl.minimum(shift, 126) + 127) << 23).to(tl.float32, bitcast=True)
    s = x * scale
    r = _round_half_even_f32(s)
    wide = shift > 126  # tiny blocks: 2**shift and the product exact in float64
    scale_wide = ((tl.minimum(shift, 1023).to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)
    sw = x.to(tl.float64) * scale_wide
    rw = _round_half_even_f64(sw)
    inexact = tl.where(wide, rw != sw, r != s)  # a non-finite block counts like the fp32 path
    # Only finite values reach the conversions (a non-finite block encodes as zeros).
    q = tl.where(wide, tl.where(wide, rw, 0.0).to(tl.int64), tl.where(e == 127, 0.0, r).to(tl.int64))
    if ADD:
        q += tl.load(out_ptr + i, mask=valid, other=0)
    tl.store(out_ptr + i, q, mask=valid)
    tl.store(count_ptr + pid, tl.sum(tl.where(valid & inexact, 1, 0).to(tl.int64), axis=0))


@triton.jit
def _decode_kernel(sum_ptr, exp_ptr, out_ptr, numel, block_size, bits, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    valid = i < numel
    total = tl.load(sum_ptr + i, mask=valid, other=0)
    e = tl.load(exp_ptr + i // block_size, mask=valid, other=0).to(tl.int32)
    shift = bits - tl.minimum(e, 126)
    scale = ((127 - tl.minimum(shift, 126)) << 23).to(tl.float32, bitcast=True)
    value = total.to(tl.float32) * scale  # int64 -> fp32 rounds to nearest even; the scale is exact
    # Results below 2**-126 (shift > 126): rounded on the integer to the subnormal grid first.
    grid = tl.maximum(shift - 149, 0).to(tl.int64)
    limit = tl.minimum(tl.maximum(shift - 126, 0), 62).to(tl.int64)
    one = tl.full(total.shape, 1, tl.int64)
    small = (tl.abs(total) < (one << limit)) & (grid > 0)
    kept = total >> grid  # floor (arithmetic shift)
    rest = total - (kept << grid)
    half = one << tl.maximum(grid - 1, 0)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    rounded = tl.where(small, (kept + up.to(tl.int64)) << grid, total)
    scale_wide = ((1023 - tl.minimum(shift, 1023).to(tl.int64)) << 52).to(tl.float64, bitcast=True)
    value_wide = (rounded.to(tl.float32).to(tl.float64) * scale_wide).to(tl.float32)
    value = tl.where(shift > 126, value_wide, value)
    nan = tl.full(value.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)  # float("nan"), the reference's bits
    value = tl.where(e == 127, nan, value)
    tl.store(out_ptr + i, value, mask=valid)


def encode_sum(buffers: list[torch.Tensor], exps: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """out = the sum of the encodings of ``buffers`` (each (num_blocks, block_size) fp32,
    contiguous); returns the inexact count as a 0-dim int64 tensor on the device (no sync)."""
    numel, block_size = buffers[0].numel(), buffers[0].shape[1]
    num_programs = max(triton.cdiv(numel, BLOCK), 1)
    counts = torch.zeros(len(buffers), num_programs, dtype=torch.int64, device=out.device)
    for j, blocks in enumerate(buffers):
        _encode_kernel[(num_programs,)](blocks, exps, out, counts[j], numel, block_size, bits, ADD=j > 0, BLOCK=BLOCK)
    return counts.sum()


def decode(sums: torch.Tensor, exps: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """out = the fp32 values of int64 ``sums`` (contiguous, (num_blocks, block_size))."""
    numel = sums.numel()
    _decode_kernel[(max(triton.cdiv(numel, BLOCK), 1),)](sums, exps, out, numel, sums.shape[1], bits, BLOCK=BLOCK)
