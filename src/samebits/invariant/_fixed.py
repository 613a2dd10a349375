"""Block fixed point: fp32 gradients as int64 integers whose sum has the same bits in any order.

A canonical block is ``block_size`` consecutive elements of one parameter's flattened
gradient (a parameter's last block may be shorter; it is padded with zeros).  Block b gets
one exponent ``e_b``: the smallest integer with ``|x| < 2**e_b`` for every element x of that
block in every micro-batch of the step, on every rank (an exact MAX all-reduce of int8
exponents).  Element x is encoded as ``q = round_half_even(x * 2**(P - e_b))``, an int64
with ``|q| <= 2**P``; ``P = 62 - ceil(log2 M)`` for M micro-batches per step, so the sum of all
M encodings fits in int64 (|sum| <= M * 2**P <= 2**62) whatever the order or grouping.

Two's-complement addition is associative and commutative, so local accumulation plus any
cross-rank SUM (ring, tree, reduce-scatter) gives the same int64 bits at every data-parallel
size.  Decoding converts that integer to fp32 once, rounding to nearest even (results in the
subnormal range are rounded on the integer first, so they are rounded once too).  When every
element encoded exactly (``x * 2**(P - e_b)`` an integer: elements within about P - 24 binary
orders of magnitude of their block's maximum), the decoded value is the correctly rounded sum
of the fp32 inputs; elements further below their block maximum lose low bits in the encoding
(counted as ``inexact``: the result is still the same at every DP size, only less accurate).
"""

from __future__ import annotations

import math

import torch

from samebits.errors import ConfigError
from samebits.invariant import _fixed_native
from samebits.kernels import fixed_point_decode, fixed_point_encode_sum, fixed_point_runs_on

DEFAULT_BLOCK_SIZE = 256
EXPONENT_MIN = -128  # int8 exponents: blocks smaller than 2**-128 encode exactly anyway (P >= 21)
EXPONENT_NONFINITE = 127  # a block holding inf or nan on any rank: the reduced block is nan
_FP32_MIN_NORMAL_EXP = -126
_FP32_MIN_SUBNORMAL_EXP = -149


def fraction_bits(num_micro_batches: int) -> int:
    """P, the binary places below the block exponent: 62 - ceil(log2 M) (headroom for M sums)."""
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ConfigError(f"num_micro_batches must be a positive int, got {num_micro_batches!r}")
    headroom = math.ceil(math.log2(num_micro_batches)) if num_micro_batches > 1 else 0
    bits = 62 - headroom
    if bits < 30:
        raise ConfigError(f"num_micro_batches={num_micro_batches}: int64 leaves only {bits} fraction bits "
                          "after the headroom for the sum (fewer than 30 would lose fp32 precision); "
                          "use fewer, larger micro-batches.")
    return bits


def pow2(exponents: torch.Tensor) -> torch.Tensor:
    """Exact float64 2**e for integer e in [-1022, 1023], built from the bits (torch.ldexp
    computes 2**e in a narrower type and flushes 2**-200 to zero)."""
    e = exponents.to(torch.int64)
    if e.numel() and (int(e.min()) < -1022 or int(e.max()) > 1023):
        raise AssertionError("power of two outside float64's normal range")
    return ((e + 1023) << 52).view(torch.float64)


def pow2_clamped(exponents: torch.Tensor) -> torch.Tensor:
    """Exact float64 2**e, e clamped to [-1022, 1023] first: for callers whose exponents
    outside that range only meet zeros (no check, so no host sync)."""
    return ((exponents.to(torch.int64).clamp(-1022, 1023) + 1023) << 52).view(torch.float64)


def block_exponents(blocks: torch.Tensor) -> torch.Tensor:
    """(num_blocks, block_size) fp32 -> (num_blocks,) int8: smallest e with |x| < 2**e, clamped
    to EXPONENT_MIN; EXPONENT_NONFINITE for a block holding inf or nan."""
    peak = blocks.abs().amax(dim=1)
    _, exp = torch.frexp(peak)  # peak = m * 2**exp, 0.5 <= m < 1, so peak < 2**exp
    exp = torch.where(peak > 0, exp, torch.full_like(exp, EXPONENT_MIN)).clamp(EXPONENT_MIN, EXPONENT_NONFINITE - 1)
    exp = torch.where(torch.isfinite(peak), exp, torch.full_like(exp, EXPONENT_NONFINITE))
    return exp.to(torch.int8)


def _pow2_f32(exponents: torch.Tensor) -> torch.Tensor:
    """Exact float32 2**e for integer e in [-126, 127], built from the bits."""
    return ((exponents.to(torch.int32) + 127) << 23).view(torch.float32)


def encode(blocks: torch.Tensor, exponents: torch.Tensor, bits: int) -> tuple[torch.Tensor, int]:
    """(num_blocks, block_size) fp32 -> (int64 of the same shape, number of inexact elements).

    Every element must satisfy |x| < 2**e of its block (the exponents come from a MAX over
    every input).  A non-finite block encodes as zeros (its result is nan, see `decode`).
    Scaling by 2**(P - e) is exact in fp32 while P - e <= 126 (the result stays below 2**62);
    blocks that need a larger scale (tiny or all-zero blocks) are scaled in float64.
    """
    shift = bits - exponents.to(torch.int64).clamp(max=EXPONENT_NONFINITE - 1)
    scaled = blocks * _pow2_f32(shift.clamp(max=126))[:, None]
    rounded = torch.round(scaled)  # half to even; exact in fp32 (an integer of at most 62 bits)
    inexact = int((rounded != scaled).sum())
    out = rounded.to(torch.int64)
    # All-zero blocks (exponent EXPONENT_MIN: every zero gradient when each element is its own
    # block) encode as zeros on the fp32 path already; only nonzero ones need float64.
    wide = ((shift > 126) & (blocks != 0).any(dim=1)).nonzero().flatten()
    if wide.numel():
        rows = blocks[wide].to(torch.float64) * pow2(shift[wide])[:, None]
        rows_rounded = torch.round(rows)
        inexact += int((rows_rounded != rows).sum()) - int((rounded[wide] != scaled[wide]).sum())
        out[wide] = rows_rounded.to(torch.int64)
    nonfinite = (exponents == EXPONENT_NONFINITE).nonzero().flatten()
    if nonfinite.numel():
        out[nonfinite] = 0
    return out, inexact


def decode(sums: torch.Tensor, exponents: torch.Tensor, bits: int) -> torch.Tensor:
    """(num_blocks, block_size) int64 sums -> fp32 ``sum * 2**(e - P)``, rounded once to nearest
    even; blocks with the non-finite exponent become nan.

    While P - e <= 126 a nonzero integer sum scales to at least 2**-126 (no subnormal result),
    so int64 -> fp32 (one rounding) times an exact fp32 power of two is the answer.  Other
    blocks go through `_decode_wide`.
    """
    shift = bits - exponents.to(torch.int64).clamp(max=EXPONENT_NONFINITE - 1)
    out = sums.to(torch.float32) * _pow2_f32(-shift.clamp(max=126))[:, None]
    wide = ((shift > 126) & (sums != 0).any(dim=1)).nonzero().flatten()  # zero sums decode to 0 as they are
    if wide.numel():
        out[wide] = _decode_wide(sums[wide], shift[wide])
    nonfinite = (exponents == EXPONENT_NONFINITE).nonzero().flatten()
    if nonfinite.numel():
        out[nonfinite] = float("nan")
    return out


def _decode_wide(sums: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`decode` for blocks scaled by more than 2**126: results below fp32's smallest normal
    (2**-126) are rounded on the integer to the subnormal grid 2**-149 (half to even) first, so
    the conversion after is exact and the value is rounded once."""
    shift = shift[:, None]
    grid = (shift + _FP32_MIN_SUBNORMAL_EXP).clamp(min=0)  # grid spacing in integer units: 2**grid
    small = (sums.abs() < torch.ones_like(sums) << (shift + _FP32_MIN_NORMAL_EXP).clamp(0, 62)) & (grid > 0)
    if bool(small.any()):
        g = grid.expand_as(sums)
        kept = sums >> g  # floor
        rest = sums - (kept << g)
        half = torch.ones_like(sums) << (g - 1).clamp(min=0)
        up = (rest > half) | ((rest == half) & (kept & 1).bool())
        sums = torch.where(small, (kept + up.to(torch.int64)) << g, sums)
    values = sums.to(torch.float32)  # int64 -> fp32 rounds to nearest even (one rounding)
    return (values.to(torch.float64) * pow2(-shift.flatten())[:, None]).to(torch.float32)  # exact scale


BACKENDS = ("auto", "torch", "native", "triton")


def _pick(backend: str, tensors: list[torch.Tensor], dtypes: list[torch.dtype], function: str,
          exponents: torch.Tensor | None = None) -> str:
    """"native" (the C library: CPU, fp32, contiguous, loaded), "triton" (CUDA tensors, Triton
    installed; "auto" picks it there) or "torch" (the definition above)."""
    if backend not in BACKENDS:
        raise ConfigError(f"{function}: backend={backend!r} is not one of {BACKENDS}; 'torch' is the reference "
                          "(the definition), 'native' the C library (CPU fp32 only), 'triton' the GPU kernels, "
                          "'auto' picks")
    if backend == "torch":
        return "torch"
    if backend == "triton" or (backend == "auto" and tensors[0].device.type == "cuda"):
        fits = (exponents is not None and fixed_point_runs_on(tensors[0].device) and exponents.dtype == torch.int8
                and [t.dtype for t in tensors] == dtypes and all(t.is_contiguous() for t in [*tensors, exponents]))
        if backend == "triton" and not fits:
            raise ConfigError(f"{function}: backend='triton' needs Triton on this device (CUDA, or "
                              "TRITON_INTERPRET=1) and contiguous tensors with int8 exponents")
        return "triton" if fits else "torch"
    native = (_fixed_native.runs_on(tensors) and [t.dtype for t in tensors] == dtypes
              and (exponents is None or (exponents.dtype == torch.int8 and exponents.device.type == "cpu"
                                         and exponents.shape == (tensors[0].shape[0],))))
    if backend == "native" and not native:
        raise ConfigError(f"{function}: backend='native' needs the compiled library "
                          f"({'not loaded: build it with `pip install -e .`' if _fixed_native.LIB is None else 'loaded'}) "
                          "and CPU, contiguous, equally shaped 2-D tensors (fp32 gradients, int64 sums)")
    return "native" if native else "torch"


def max_block_exponents(buffers: list[torch.Tensor], *, backend: str = "auto") -> torch.Tensor:
    """The MAX of `block_exponents` over ``buffers`` (a rank's micro-batches, each (num_blocks,
    block_size) fp32): one pass over all of them on the native path (torch ops on a GPU)."""
    if backend == "triton":  # no kernel of its own: a few torch ops over the GPU's memory
        backend = "torch"
    if _pick(backend, buffers, [torch.float32] * len(buffers), "max_block_exponents") == "native":
        return _fixed_native.exponents(buffers)
    exps = block_exponents(buffers[0])
    for blocks in buffers[1:]:
        exps = torch.maximum(exps, block_exponents(blocks))
    return exps


def encode_sum(buffers: list[torch.Tensor], exponents: torch.Tensor, bits: int, *, out: torch.Tensor | None = None,
               backend: str = "auto") -> tuple[torch.Tensor, int]:
    """The sum of `encode` over ``buffers`` (int64, written to ``out`` when given) and the total
    inexact count; the native path encodes and adds in one pass with no temporaries."""
    picked = _pick(backend, [*buffers, *([] if out is None else [out])],
                   [torch.float32] * len(buffers) + ([] if out is None else [torch.int64]), "encode_sum", exponents)
    if picked != "torch" and out is None:
        out = torch.empty(buffers[0].shape, dtype=torch.int64, device=buffers[0].device)
    if picked == "native":
        return out, _fixed_native.encode_sum(buffers, exponents.contiguous(), bits, out)
    if picked == "triton":
        return out, int(fixed_point_encode_sum(buffers, exponents, bits, out))
    total, inexact = encode(buffers[0], exponents, bits)
    for blocks in buffers[1:]:
        encoded, lost = encode(blocks, exponents, bits)
        total += encoded  # int64: exact, any order
        inexact += lost
    if out is not None:
        out.copy_(total)
        total = out
    return total, inexact


def decode_into(sums: torch.Tensor, exponents: torch.Tensor, bits: int, *, out: torch.Tensor | None = None,
                addends: list[torch.Tensor] = (), backend: str = "auto") -> torch.Tensor:
    """`decode` of ``sums`` plus every one of ``addends`` (int64, the same shape: the partial sums
    a reduce-scatter received, added in the same pass on the native path), written to ``out``
    (fp32) when given."""
    extra = list(addends)
    picked = _pick(backend, [sums, *extra, *([] if out is None else [out])],
                   [torch.int64] * (1 + len(extra)) + ([] if out is None else [torch.float32]), "decode_into",
                   exponents)
    if picked != "torch" and out is None:
        out = torch.empty(sums.shape, dtype=torch.float32, device=sums.device)
    if picked == "native":
        _fixed_native.decode(sums, exponents.contiguous(), bits, out, extra)
        return out
    if picked == "triton":
        for addend in extra:
            sums = sums + addend  # int64: exact, any order
        return fixed_point_decode(sums, exponents, bits, out)
    for addend in extra:
        sums = sums + addend  # int64: exact, any order
    values = decode(sums, exponents, bits)
    if out is None:
        return values
    return out.copy_(values)


def reduce_here(buffers: list[torch.Tensor], bits: int, *, out: torch.Tensor, backend: str = "auto") -> tuple[int, int]:
    """The reduction where every contribution is on this rank (one rank, or the owner of its
    rows): `max_block_exponents`, `encode_sum` and `decode_into` in turn, written to ``out``
    (fp32).  Returns (inexact elements, non-finite blocks).  The native path does the three in
    one pass, with no exponent or int64 buffer."""
    if backend in ("auto", "native") and _pick(backend, [*buffers, out], [torch.float32] * (len(buffers) + 1),
                                               "reduce_here") == "native":
        return _fixed_native.reduce(buffers, bits, out)
    exps = max_block_exponents(buffers, backend=backend)
    total, inexact = encode_sum(buffers, exps, bits, backend=backend)
    decode_into(total, exps, bits, out=out, backend=backend)
    return inexact, int((exps == EXPONENT_NONFINITE).sum())


__all__ = ["DEFAULT_BLOCK_SIZE", "fraction_bits", "block_exponents", "encode", "decode", "pow2", "pow2_clamped",
           "EXPONENT_MIN", "EXPONENT_NONFINITE", "BACKENDS", "max_block_exponents", "encode_sum", "decode_into",
           "reduce_here"]
