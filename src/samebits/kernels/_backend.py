"""Decides whether the Triton kernels can run for a tensor, and validates shared options.

Triton is optional: nothing here imports it at module load, so `import samebits.kernels`
works without it.  The kernel modules (`_triton_*.py`) are imported on first use, because
importing them decorates the kernels and `@triton.jit` reads `TRITON_INTERPRET` at that
moment: set the variable before the first kernel call, not after.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

from samebits.errors import ConfigError

VARIANTS = ("deterministic", "atomic", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """True when the Triton kernels run here: Triton is installed and either a CUDA device is
    present or `TRITON_INTERPRET=1` is set (CPU interpreter, slow, for tests).

    When False, every public function of `samebits.kernels` falls back to its torch reference.
    """
    return triton_installed() and (interpret_mode() or torch.cuda.is_available())


def triton_runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel can take tensors on `device`: CUDA tensors need Triton and a
    GPU; CPU tensors need the interpreter."""
    if not triton_installed():
        return False
    if interpret_mode():
        return True
    return device.type == "cuda" and torch.cuda.is_available()


def check_variant(variant: str, function: str) -> None:
    if variant not in VARIANTS:
        raise ConfigError(
            f"{function}: variant={variant!r} is not one of {VARIANTS}; use 'deterministic' "
            "(private slots, fixed-order sum), 'atomic' (arrival-order atomics, for comparison) "
            "or 'torch' (the reference implementation)"
        )


def check_block(name: str, value: int, function: str, minimum: int = 1) -> None:
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ConfigError(
            f"{function}: {name}={value!r} must be a power of two >= {minimum} "
            "(Triton block shapes are powers of two)"
        )


def warn_fallback(function: str, variant: str, device: torch.device) -> None:
    """Say once per call site that a Triton variant was asked for but the torch reference ran."""
    reason = (
        "Triton is not installed"
        if not triton_installed()
        else f"tensors are on {device} and TRITON_INTERPRET is not set"
    )
    warnings.warn(
        f"{function}(variant={variant!r}): {reason}, so the torch reference ran instead "
        "(deterministic, but not the kernel you asked to measure); pass variant='torch' to "
        "select it on purpose",
        stacklevel=3,
    )
