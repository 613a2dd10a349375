"""Loads the compiled CPU body-sum library (csrc/digest.c) with ctypes; None if not built.

setup.py builds it as the extension module `samebits.fingerprint._libdigest`, a plain shared
library without Python API (ctypes releases the GIL while it runs).  torch is imported first
on purpose: the library links libgomp.so.1, and when torch's own copy of that soname is
already loaded the dynamic loader reuses it, so the process has a single OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import os
import warnings
from array import array

import numpy as np

import torch  # noqa: F401  (loads torch's libgomp before ours; see the module docstring)

from samebits._cdll import load_library
from samebits.errors import ConfigError

_ABI_VERSION = 4  # the ABI version in csrc/digest.c (3: digest version 2, samebits_body_sum_with; 4: step frames)
_BUILD_HINT = "build it with `pip install -e .` (or `pip install .`) from the samebits repository"


def _load() -> ctypes.CDLL | None:
    lib = load_library("samebits.fingerprint._libdigest", "samebits_digest_abi_version", _ABI_VERSION, _BUILD_HINT)
    if lib is None:
        return None
    lib.samebits_digest_isa.restype = ctypes.c_char_p
    lib.samebits_digest_has_openmp.restype = ctypes.c_int
    lib.samebits_body_sum_at.restype = ctypes.c_uint64
    lib.samebits_body_sum_at.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    lib.samebits_body_sum_with.restype = ctypes.c_int
    lib.samebits_body_sum_with.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64,
                                           ctypes.c_void_p]
    lib.samebits_body_sums.restype = None
    lib.samebits_body_sums.argtypes = [
        ctypes.c_uint64,  # num_tensors
        ctypes.c_void_p,  # const uint64_t *data_ptrs
        ctypes.c_void_p,  # const uint64_t *num_bytes
        ctypes.c_void_p,  # uint64_t *out_sums
        ctypes.c_int,  # num_threads
    ]
    lib.samebits_finalize_into.restype = None
    lib.samebits_finalize_into.argtypes = [
        ctypes.c_char_p,  # const unsigned char *template (a bytes object, passed without a copy)
        ctypes.c_uint64,  # num_bytes
        ctypes.c_uint64,  # n
        ctypes.c_void_p,  # const uint64_t *sums
        ctypes.c_void_p,  # const int64_t *sum_indices
        ctypes.c_void_p,  # const uint64_t *headers
        ctypes.c_void_p,  # const int64_t *offsets
        ctypes.c_void_p,  # unsigned char *out
    ]
    lib.samebits_step_frame.restype = ctypes.c_uint64
    lib.samebits_step_frame.argtypes = [
        ctypes.c_char_p,  # const unsigned char *names_key (32 bytes)
        ctypes.c_uint64,  # step
        ctypes.c_uint64,  # num_records
        ctypes.c_void_p,  # const unsigned char *body (bytes, or a ctypes array over a bytearray)
        ctypes.c_uint64,  # body_len
        ctypes.c_void_p,  # unsigned char *out
        ctypes.c_uint64,  # out_capacity
        ctypes.c_void_p,  # uint64_t *root
    ]
    lib.samebits_sha256_two.restype = None
    lib.samebits_sha256_two.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_uint64,
                                        ctypes.c_char_p]
    lib.samebits_crc32.restype = ctypes.c_uint32
    lib.samebits_crc32.argtypes = [ctypes.c_uint32, ctypes.c_char_p, ctypes.c_uint64]
    lib.samebits_sha256_variant.restype = ctypes.c_char_p
    return lib


LIB: ctypes.CDLL | None = _load()
_warned_missing = False

# libgomp does not survive fork: in a child forked after the parent ran a parallel region,
# the next parallel region hangs (torch's own ops included).  Children stay single-threaded.
_in_forked_child = False


def _mark_forked_child() -> None:
    global _in_forked_child
    _in_forked_child = True


os.register_at_fork(after_in_child=_mark_forked_child)


def available() -> bool:
    """Whether the compiled library is loaded."""
    return LIB is not None


def warn_missing() -> None:
    """Warn, once per process, that CPU digests use the slow torch reference."""
    global _warned_missing
    if not _warned_missing:
        _warned_missing = True
        warnings.warn(
            "samebits: the compiled digest library (samebits/fingerprint/_libdigest*.so) is not "
            "built, so CPU digests use the torch reference implementation (same digests, about "
            f"30x slower); {_BUILD_HINT}",
            stacklevel=3,
        )


def describe() -> str:
    """One line for benchmarks and bug reports: which variant runs, with or without OpenMP."""
    if LIB is None:
        return "not built (torch reference)"
    openmp = "OpenMP" if LIB.samebits_digest_has_openmp() else "no OpenMP"
    return f"{LIB.samebits_digest_isa().decode()}, {openmp}"


def body_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Body sums of row-major CPU tensors in one native call: int64 tensor of shape [n]."""
    assert LIB is not None
    num_tensors = len(tensors)
    data_ptrs = array("Q", [t.data_ptr() for t in tensors])
    num_bytes = array("Q", [t.nbytes for t in tensors])
    if 0 in data_ptrs:  # a tensor without storage: reading it would crash the process
        for t, ptr, size in zip(tensors, data_ptrs, num_bytes):
            if ptr == 0 and size > 0:
                raise ConfigError(
                    f"samebits cannot digest this {type(t).__name__}: it has {size} bytes but "
                    "no data pointer (a tensor subclass without storage?)"
                )
    out = torch.empty(num_tensors, dtype=torch.int64)
    _sums_into(data_ptrs, num_bytes, out.data_ptr())
    return out


def body_sums_into(data_ptrs: list[int], num_bytes: array, out_address: int) -> None:
    """`body_sums` of buffers given by address and size (the caller read the addresses of
    checked, row-major CPU tensors that it keeps alive), written as uint64 at ``out_address``."""
    assert LIB is not None and len(data_ptrs) == len(num_bytes)
    _sums_into(array("Q", data_ptrs), num_bytes, out_address)


def _sums_into(data_ptrs: array, num_bytes: array, out_address: int) -> None:
    LIB.samebits_body_sums(len(data_ptrs), data_ptrs.buffer_info()[0], num_bytes.buffer_info()[0], out_address,
                           1 if _in_forked_child else torch.get_num_threads())  # torch's thread budget, never more


class StepFinalizer:
    """Puts a step's digests into a copy of its encoded records in one native call (the
    Recorder's step templates): ``fill(sums_address, num_sums)`` returns ``body`` with, for each
    k, the 8 bytes of ``D = fmix64(headers[k] ^ sums[sum_indices[k]])`` at ``offsets[k]``.  The
    returned bytearray is this object's own, overwritten by the next ``fill``; ``pointer`` is its
    address for another native call."""

    def __init__(self, body: bytes, sum_indices: np.ndarray, headers: np.ndarray, offsets: np.ndarray):
        assert LIB is not None
        self.body = bytes(body)
        self.sum_indices = np.ascontiguousarray(sum_indices, dtype=np.int64)
        self.headers = np.ascontiguousarray(headers, dtype=np.uint64)
        self.offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        n = len(self.sum_indices)
        if not (len(self.headers) == len(self.offsets) == n):
            raise ValueError(f"StepFinalizer: {n} sum indices, {len(self.headers)} headers, {len(self.offsets)} offsets")
        if n and not (self.offsets.min() >= 0 and self.offsets.max() + 8 <= len(self.body)
                      and self.sum_indices.min() >= 0):
            raise ValueError("StepFinalizer: a digest offset outside the body, or a negative sum index")
        self.num_sums_needed = int(self.sum_indices.max()) + 1 if n else 0
        self.out = bytearray(len(self.body))
        self.pointer = (ctypes.c_char * len(self.out)).from_buffer(self.out)  # pins out's buffer
        self._args = (self.body, len(self.body), n)
        self._pointers = (self.sum_indices.ctypes.data, self.headers.ctypes.data, self.offsets.ctypes.data,
                          ctypes.addressof(self.pointer))

    def fill(self, sums_address: int, num_sums: int) -> bytearray:
        """``sums_address``: the address of the step's ``num_sums`` body sums (uint64, on the
        CPU, kept alive by the caller)."""
        if num_sums < self.num_sums_needed:
            raise ValueError(f"StepFinalizer.fill: {num_sums} sums, the template reads {self.num_sums_needed}")
        indices, headers, offsets, out = self._pointers
        LIB.samebits_finalize_into(*self._args, sums_address, indices, headers, offsets, out)
        return self.out


class StepFramer:
    """Encodes STEP frames (stream/_format.py: ``frame(FRAME_STEP, ...)`` with the step root of
    `step_root`) in one native call: SHA-256, varints and CRC-32 in C.  ``frame`` returns a
    memoryview of this object's own buffer, valid until the next call."""

    def __init__(self):
        assert LIB is not None
        self._root = ctypes.c_uint64()
        self._root_address = ctypes.addressof(self._root)
        self._grow(4096)

    def _grow(self, capacity: int) -> None:
        self._out = bytearray(capacity)
        self._out_view = (ctypes.c_char * capacity).from_buffer(self._out)
        self._out_address = ctypes.addressof(self._out_view)

    def frame(self, names_key: bytes, step: int, num_records: int, body, body_length: int) -> tuple[memoryview, int]:
        """(the frame's bytes, the step root).  ``body``: bytes, or a ctypes pointer/array over a
        buffer of ``body_length`` bytes (`StepFinalizer.pointer`)."""
        if len(names_key) != 32:
            raise ValueError(f"StepFramer.frame: the names key has {len(names_key)} bytes, not 32")
        if isinstance(body, (bytes, bytearray)) and len(body) != body_length:
            raise ValueError(f"StepFramer.frame: body_length {body_length} for a body of {len(body)} bytes")
        needed = body_length + 43  # kind, 10-byte length, two 10-byte varints, root, crc
        if needed > len(self._out):
            self._grow(max(needed, 2 * len(self._out)))
        size = LIB.samebits_step_frame(names_key, step, num_records, body, body_length, self._out_address,
                                       len(self._out), self._root_address)
        if size == 0:
            raise RuntimeError(f"samebits_step_frame: a frame of {body_length} body bytes did not fit")
        return memoryview(self._out)[:size], self._root.value


def body_sum_at(data: torch.Tensor, first_word: int) -> int:
    """Unsigned body sum of row-major CPU `data` as if its first word had index `first_word`."""
    assert LIB is not None
    return LIB.samebits_body_sum_at(data.data_ptr(), data.nbytes, first_word)


def body_sum_with(isa: str, data: torch.Tensor, first_word: int = 0) -> int | None:
    """`body_sum_at` computed by one named vector loop ("portable", "sse2", "avx2", "avx512f")
    instead of the one picked for this CPU; None when this build or CPU lacks it.  For tests."""
    assert LIB is not None
    out = ctypes.c_uint64()
    if not LIB.samebits_body_sum_with(isa.encode(), data.data_ptr(), data.nbytes, first_word, ctypes.byref(out)):
        return None
    return out.value
