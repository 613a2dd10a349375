"""One loader for samebits' compiled C libraries (setup.py builds them as plain shared libraries
without Python API; ctypes releases the GIL while they run)."""

from __future__ import annotations

import ctypes
import importlib.util
import warnings


def load_library(module: str, abi_function: str, abi_version: int, fallback: str) -> ctypes.CDLL | None:
    """The library built as ``module`` if it loads and ``abi_function()`` reports ``abi_version``;
    None if it is not built, and None with a warning naming ``fallback`` (what runs instead, and
    how to rebuild) if it cannot load or is from another samebits version."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as err:
        warnings.warn(f"samebits: cannot load {spec.origin} ({err}); {fallback}", stacklevel=3)
        return None
    abi = getattr(lib, abi_function)
    abi.restype = ctypes.c_int
    if abi() != abi_version:
        warnings.warn(f"samebits: {spec.origin} is from another samebits version; {fallback}", stacklevel=3)
        return None
    return lib


__all__ = ["load_library"]
