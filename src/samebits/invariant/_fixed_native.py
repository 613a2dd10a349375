"""Loads the compiled block fixed point (fingerprint/csrc/fixed.c) with ctypes; None if not built.

setup.py builds it as `samebits.invariant._libfixed`, a plain shared library without Python
API (ctypes releases the GIL while it runs), apart from the digest library so that neither
changes the other's interface.  The torch functions of `_fixed` are its definition: every
output bit and the inexact count must be the same (tests/test_invariant_native.py).  torch is
imported first on purpose: the library links libgomp.so.1, and torch's copy, loaded first, is
the one the process then uses (a single OpenMP runtime).
"""

from __future__ import annotations

import ctypes
import os
from array import array

import torch

from samebits._cdll import load_library

_ABI_VERSION = 4  # the ABI version fixed.c reports (samebits_fixed_abi_version)


def _load() -> ctypes.CDLL | None:
    lib = load_library("samebits.invariant._libfixed", "samebits_fixed_abi_version", _ABI_VERSION,
                       "the invariant reduction uses its torch path (same bits, slower); rebuild with "
                       "`pip install -e .`")
    if lib is None:
        return None
    lib.samebits_fixed_has_openmp.restype = ctypes.c_int
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    lib.samebits_fixed_exponents.restype = None
    lib.samebits_fixed_exponents.argtypes = [ctypes.c_uint64, pointer, size, size, pointer, ctypes.c_int]
    lib.samebits_fixed_encode_sum.restype = ctypes.c_int64
    lib.samebits_fixed_encode_sum.argtypes = [ctypes.c_uint64, pointer, size, size, pointer, ctypes.c_int, pointer,
                                              ctypes.c_int]
    lib.samebits_fixed_decode.restype = None
    lib.samebits_fixed_decode.argtypes = [pointer, ctypes.c_uint64, pointer, size, size, pointer, ctypes.c_int, pointer,
                                          ctypes.c_int]
    lib.samebits_fixed_reduce.restype = ctypes.c_int64
    lib.samebits_fixed_reduce.argtypes = [ctypes.c_uint64, pointer, size, size, ctypes.c_int, pointer, pointer,
                                          ctypes.c_int]
    lib.samebits_fixed_peaks.restype = None
    lib.samebits_fixed_peaks.argtypes = [ctypes.c_uint64, pointer, pointer, pointer]
    lib.samebits_fixed_square_sums.restype = None
    lib.samebits_fixed_square_sums.argtypes = [ctypes.c_uint64, pointer, pointer, pointer, pointer, ctypes.c_int]
    return lib


LIB: ctypes.CDLL | None = _load()

# libgomp does not survive fork (a parallel region in a child forked after the parent ran one
# hangs): children stay single-threaded, as in fingerprint/_native.py.
_in_forked_child = False


def _mark_forked_child() -> None:
    global _in_forked_child
    _in_forked_child = True


os.register_at_fork(after_in_child=_mark_forked_child)


def describe() -> str:
    """One line for benchmarks and bug reports: whether the CPU passes run natively."""
    if LIB is None:
        return "not built (torch path)"
    return f"native ({'OpenMP' if _has_openmp() else 'no OpenMP'}, {torch.get_num_threads()} threads)"


def _has_openmp() -> bool:
    return bool(LIB.samebits_fixed_has_openmp())


def _threads() -> int:
    return 1 if _in_forked_child else torch.get_num_threads()  # torch's thread budget, never more


def runs_on(tensors: list[torch.Tensor]) -> bool:
    """Whether the library is loaded and takes these tensors: CPU, contiguous, one shape."""
    if LIB is None:
        return False
    shape = tensors[0].shape
    return all(t.device.type == "cpu" and t.is_contiguous() and t.shape == shape and t.dim() == 2 for t in tensors)


def _addresses(buffers: list[torch.Tensor]) -> array:
    return array("Q", [b.data_ptr() for b in buffers])


def exponents(buffers: list[torch.Tensor]) -> torch.Tensor:
    """`_fixed.block_exponents` of every buffer, MAX over the buffers, in one pass: (num_blocks,) int8."""
    num_blocks, block_size = buffers[0].shape
    out = torch.empty(num_blocks, dtype=torch.int8)
    addresses = _addresses(buffers)
    LIB.samebits_fixed_exponents(len(buffers), addresses.buffer_info()[0], num_blocks, block_size, out.data_ptr(),
                                 _threads())
    return out


def encode_sum(buffers: list[torch.Tensor], exps: torch.Tensor, bits: int, out: torch.Tensor) -> int:
    """out = the sum of `_fixed.encode` of every buffer (int64, written); returns the inexact count."""
    num_blocks, block_size = buffers[0].shape
    addresses = _addresses(buffers)
    return LIB.samebits_fixed_encode_sum(len(buffers), addresses.buffer_info()[0], num_blocks, block_size,
                                         exps.data_ptr(), bits, out.data_ptr(), _threads())


def decode(sums: torch.Tensor, exps: torch.Tensor, bits: int, out: torch.Tensor,
           addends: list[torch.Tensor] = ()) -> None:
    """out = `_fixed.decode` of int64 ``sums`` + every addend (added in the same pass) (fp32, written)."""
    num_blocks, block_size = sums.shape
    addresses = _addresses(list(addends))
    LIB.samebits_fixed_decode(sums.data_ptr(), len(addresses), addresses.buffer_info()[0], num_blocks, block_size,
                              exps.data_ptr(), bits, out.data_ptr(), _threads())


def reduce(buffers: list[torch.Tensor], bits: int, out: torch.Tensor) -> tuple[int, int]:
    """out = `decode` of `encode_sum` at the `exponents` of ``buffers``, in one pass (fp32,
    written); returns (inexact elements, non-finite blocks)."""
    num_blocks, block_size = buffers[0].shape
    addresses = _addresses(buffers)
    nonfinite = ctypes.c_int64(0)
    inexact = LIB.samebits_fixed_reduce(len(buffers), addresses.buffer_info()[0], num_blocks, block_size, bits,
                                        out.data_ptr(), ctypes.addressof(nonfinite), _threads())
    return inexact, nonfinite.value


def _takes_flat(tensors: list[torch.Tensor]) -> bool:
    """Whether the library is loaded and every tensor is contiguous fp32 on the CPU."""
    return LIB is not None and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                                   for t in tensors)


def peaks(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """`_norm`'s largest |x| per tensor (fp32; 0 for an empty one, nan where one is), or None
    where `_takes_flat` does not hold (the torch path then)."""
    if not _takes_flat(tensors):
        return None
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    out = torch.empty(len(tensors), dtype=torch.int32)
    addresses = _addresses(tensors)
    LIB.samebits_fixed_peaks(len(tensors), addresses.buffer_info()[0], numels.data_ptr(), out.data_ptr())
    return out.view(torch.float32)


def square_sums(tensors: list[torch.Tensor], scales: torch.Tensor) -> torch.Tensor | None:
    """`_norm`'s int64 sums of round(x * x * scale) per tensor (inf and nan as 0), or None where
    `_takes_flat` does not hold (the torch path then)."""
    if not _takes_flat(tensors):
        return None
    scales = scales.to(device="cpu", dtype=torch.float64).contiguous()
    numels = torch.tensor([t.numel() for t in tensors], dtype=torch.int64)
    out = torch.empty(len(tensors), dtype=torch.int64)
    addresses = _addresses(tensors)
    LIB.samebits_fixed_square_sums(len(tensors), addresses.buffer_info()[0], numels.data_ptr(), scales.data_ptr(),
                                   out.data_ptr(), _threads())
    return out
