"""The digest spec's constants, dtype codes and host-side steps (header, final mix): metadata
and 64-bit integers only, never tensor data.  docs/digest.md is the spec.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from samebits.errors import ConfigError
from samebits.fingerprint._codes import DTYPE_CODE_BY_NAME as _DTYPE_CODE_BY_NAME

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # G: word j is offset by (j+1)*G before mixing
HEADER_SEED = 0x243F6A8885A308D3  # H starts here (the hex digits of pi)
FMIX_MUL1 = 0xFF51AFD7ED558CCD
FMIX_MUL2 = 0xC4CEB9FE1A85EC53

# mix2's round keys, in order: even 32-bit constants (evenness makes each round a bijection).
MIX_KEYS = (0x9E3779B8, 0x85EBCA6A, 0xC2B2AE34, 0x27D4EB2E, 0x165667B0)
MASK32 = (1 << 32) - 1


DTYPE_CODES: types.MappingProxyType[torch.dtype, int] = types.MappingProxyType(
    {getattr(torch, name): code for name, code in _DTYPE_CODE_BY_NAME.items()
     if isinstance(getattr(torch, name, None), torch.dtype)})

# Quantized tensors are refused: their value also depends on scale/zero point, which are not
# in their bytes, so a digest of the bytes alone would call different tensors equal.
_QUANTIZED = {getattr(torch, name) for name in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
              if hasattr(torch, name)}
_QUANTIZED_HINT = ("quantized tensors keep their scale and zero point outside their bytes; digest "
                   "t.int_repr() and the quantization parameters instead")


def dtype_code(dtype: torch.dtype) -> int:
    """The spec's DTYPE_CODE of `dtype`; ValueError naming the supported dtypes if it has none."""
    code = DTYPE_CODES.get(dtype)
    if code is None:
        supported = ", ".join(str(d).removeprefix("torch.") for d in DTYPE_CODES)
        hint = f" ({_QUANTIZED_HINT})" if dtype in _QUANTIZED else ""
        raise ConfigError(
            f"samebits cannot digest tensors of dtype {dtype}{hint}; supported dtypes: {supported}"
        )
    return code


def fmix64(x: int) -> int:
    """The murmur3 64-bit finalizer on a Python int (taken mod 2^64)."""
    x &= MASK64
    x ^= x >> 33
    x = (x * FMIX_MUL1) & MASK64
    x ^= x >> 33
    x = (x * FMIX_MUL2) & MASK64
    x ^= x >> 33
    return x


def mix2(x: int) -> int:
    """The body's word mixer (digest version 2) on a Python int (taken mod 2^64)."""
    x &= MASK64
    for key in MIX_KEYS:
        x ^= (x & MASK32) * key
        x = (x >> 32) | ((x & MASK32) << 32)
    return x


@functools.lru_cache(maxsize=65536)
def _header(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    num_bytes = math.prod(shape) * dtype.itemsize
    h = HEADER_SEED
    for x in (dtype_code(dtype), len(shape), *shape, num_bytes):
        h = fmix64(h ^ x)
    return h


def header(dtype: torch.dtype, shape: Sequence[int]) -> int:
    """The spec's header H of a tensor with this dtype and shape (step 4); cached, since a
    training step digests the same (dtype, shape) pairs every step."""
    return _header(dtype, shape if isinstance(shape, tuple) else tuple(shape))  # torch.Size is one


def finalize(body_sums: torch.Tensor | Iterable[int], headers: Sequence[int]) -> list[int]:
    """Digests D = fmix64(H ^ S) (step 5) as unsigned ints, from `body_sums()`'s tensor (reading
    it is the one host synchronisation) or any ints (taken mod 2^64), and their headers."""
    body_sums = body_sums.tolist() if isinstance(body_sums, torch.Tensor) else list(body_sums)
    if len(body_sums) != len(headers):
        raise ConfigError(
            f"finalize got {len(body_sums)} body sums but {len(headers)} headers; pass one "
            "header per tensor, in the order given to body_sums()"
        )
    # A Python loop: 0.3 us per tensor, cheaper than numpy's fixed cost below ~1000 tensors.
    return [fmix64(h ^ (s & MASK64)) for h, s in zip(headers, body_sums)]


_NP_MUL1, _NP_MUL2, _NP_SHIFT = np.uint64(FMIX_MUL1), np.uint64(FMIX_MUL2), np.uint64(33)


def finalize_packed(body_sums: np.ndarray, headers: Sequence[int]) -> bytes:
    """`finalize` of a uint64 numpy array of sums, as the digests' little-endian u64 bytes,
    concatenated: one array op per mixing step for a whole step (numpy wraps mod 2^64)."""
    x = np.array(headers, dtype=np.uint64)
    if x.shape != body_sums.shape:
        raise ConfigError(f"finalize_packed got {body_sums.size} body sums but {x.size} headers; "
                          "pass one header per tensor, in the order of the sums")
    x ^= body_sums
    x ^= x >> _NP_SHIFT
    x *= _NP_MUL1
    x ^= x >> _NP_SHIFT
    x *= _NP_MUL2
    x ^= x >> _NP_SHIFT
    return x.astype("<u8", copy=False).tobytes()
