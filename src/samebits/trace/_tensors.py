"""Tensor helpers of the tracing rungs: which tensors can be digested, tensor versions, and
the one-ulp nudge of the test hook.  (Leaves of nested values and call sites are shared with
the rest of samebits: `samebits._torchutil`.)"""

from __future__ import annotations

import os

import torch

from samebits._torchutil import int_view

TRACE_DIR = os.path.dirname(os.path.abspath(__file__))  # call sites skip the tracer's own frames


def digestable(t) -> bool:
    """Plain dense tensors with data; subclasses (fake, DTensor) and meta tensors are skipped."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.layout is torch.strided \
        and not t.is_meta


def version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never treat them as seen
        return None


def geometry(t: torch.Tensor) -> str:
    """``@offset:(sizes):(strides)``: where a view sits in its base's storage."""
    try:
        return f"@{t.storage_offset()}:{tuple(t.shape)}:{t.stride()}"
    except (RuntimeError, NotImplementedError):  # no strides (sparse, nested)
        return f"@?:{tuple(t.shape)}"


def nudge(t: torch.Tensor) -> None:
    """Move the first element of ``t`` by one ulp (a complex one's real part; integers by one,
    booleans flipped), in place."""
    if t.numel() == 0:
        return
    if t.is_complex():
        t = torch.view_as_real(t)
    index = (0,) * t.dim()
    if t.dtype is torch.bool:
        t[index] = ~t[index]
    elif t.is_floating_point():
        int_view(t)[index] += 1
    else:
        t[index] += 1
