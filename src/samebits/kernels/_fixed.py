"""Public block fixed point of the invariant reduction on the GPU: the Triton kernels of
`_triton_fixed` (samebits.invariant._fixed is their definition and calls these for CUDA
tensors when Triton runs there)."""

from __future__ import annotations

import importlib

import torch

from samebits.errors import ConfigError
from samebits.kernels import _backend


def fixed_point_runs_on(device: torch.device) -> bool:
    """Whether `fixed_point_encode_sum` and `fixed_point_decode` run on ``device`` (CUDA with
    Triton, or any device under TRITON_INTERPRET=1)."""
    return _backend.triton_runs_on(device)


def _check(tensors: list[torch.Tensor], dtypes: list[torch.dtype], exps: torch.Tensor, function: str) -> None:
    shape = tensors[0].shape
    for t, dtype in zip(tensors, dtypes):
        if t.dtype != dtype or t.shape != shape or t.dim() != 2 or not t.is_contiguous() or t.device != exps.device:
            raise ConfigError(f"{function}: expected contiguous (num_blocks, block_size) tensors of {dtypes} on "
                              f"{exps.device}, got {t.dtype} {tuple(t.shape)} on {t.device} "
                              f"(contiguous={t.is_contiguous()})")
    if exps.dtype != torch.int8 or exps.shape != (shape[0],) or not exps.is_contiguous():
        raise ConfigError(f"{function}: exponents must be contiguous int8 of shape ({shape[0]},), got {exps.dtype} "
                          f"{tuple(exps.shape)}")


def fixed_point_encode_sum(buffers: list[torch.Tensor], exps: torch.Tensor, bits: int,
                           out: torch.Tensor) -> torch.Tensor:
    """out = the sum over ``buffers`` of their int64 block fixed-point encodings; returns the
    inexact count, a 0-dim int64 tensor on the device (read it when needed: no sync here)."""
    _check([*buffers, out], [torch.float32] * len(buffers) + [torch.int64], exps, "fixed_point_encode_sum")
    return _kernels().encode_sum(buffers, exps, bits, out)


def fixed_point_decode(sums: torch.Tensor, exps: torch.Tensor, bits: int, out: torch.Tensor) -> torch.Tensor:
    """out = the fp32 values of int64 block sums, rounded once; returns ``out``."""
    _check([sums, out], [torch.int64, torch.float32], exps, "fixed_point_decode")
    _kernels().decode(sums, exps, bits, out)
    return out


def _kernels():
    """The Triton module, imported on first use: importing it imports triton (optional) and
    decorates the kernels, which reads TRITON_INTERPRET at that moment (see _backend)."""
    return importlib.import_module("samebits.kernels._triton_fixed")
