"""Loads the compiled CPU body-sum library (csrc/digest.c) with ctypes; None if not built.

setup.py builds it as the extension module `samebits.fingerprint._libdigest`, a plain shared
library without Python API (ctypes releases the GIL while it runs).  torch is imported first
on purpose: the library links libgomp.so.1, and when torch's own copy of that soname is
already loaded the dynamic loader reuses it, so the process has a single OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import warnings
from array import array

import torch  # noqa: F401  (loads torch's libgomp before ours; see the module docstring)

from samebits.errors import ConfigError

_ABI_VERSION = 3  # the ABI version in csrc/digest.c (3: digest version 2, samebits_body_sum_with)
_BUILD_HINT = "build it with `pip install -e .` (or `pip install .`) from the samebits repository"


def _load() -> ctypes.CDLL | None:
    spec = importlib.util.find_spec("samebits.fingerprint._libdigest")
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as err:
        warnings.warn(f"samebits: cannot load {spec.origin} ({err}); {_BUILD_HINT}", stacklevel=2)
        return None
    lib.samebits_digest_abi_version.restype = ctypes.c_int
    if lib.samebits_digest_abi_version() != _ABI_VERSION:
        warnings.warn(
            f"samebits: {spec.origin} is from another samebits version; {_BUILD_HINT}",
            stacklevel=2,
        )
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
    LIB.samebits_body_sums(
        num_tensors,
        data_ptrs.buffer_info()[0],
        num_bytes.buffer_info()[0],
        out.data_ptr(),
        1 if _in_forked_child else torch.get_num_threads(),  # torch's thread budget, never more
    )
    return out


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
