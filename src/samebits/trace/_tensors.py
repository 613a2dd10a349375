"""Helpers every tracing rung shares: a value's tensor leaves, which tensors can be digested,
tensor versions, the user's call site, and the one-ulp nudge of the test hook."""

from __future__ import annotations

import os
import sys

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_TRACE_DIR = os.path.dirname(os.path.abspath(__file__))


def tensor_leaves(value, prefix: str = ""):
    """(label, tensor) pairs of a module's inputs or outputs: tensors, lists, tuples, dicts,
    dataclass-like objects (one level of nesting each)."""
    if isinstance(value, torch.Tensor):
        yield prefix or "0", value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from tensor_leaves(item, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensor_leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif hasattr(value, "__dataclass_fields__"):
        for key in value.__dataclass_fields__:
            yield from tensor_leaves(getattr(value, key), f"{prefix}.{key}" if prefix else key)


def digestable(t) -> bool:
    """Plain dense tensors with data; subclasses (fake, DTensor) and meta tensors are skipped."""
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.layout is torch.strided \
        and not t.is_meta


def version_of(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version: never treat them as seen
        return None


def call_site(skip_frames: int = 2) -> str | None:
    """file:line in function of the nearest caller outside torch and samebits.trace."""
    frame = sys._getframe(skip_frames)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith(_TORCH_DIR) or filename.startswith(_TRACE_DIR) or filename.startswith("<")):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def nudge(t: torch.Tensor) -> None:
    """Move the first element of ``t`` by one ulp (integers by one, booleans flipped), in place."""
    if t.numel() == 0:
        return
    index = (0,) * t.dim()
    if t.dtype is torch.bool:
        t[index] = ~t[index]
    elif t.is_floating_point() or t.is_complex():
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        if t.is_complex():
            t = torch.view_as_real(t)
            index = (0,) * t.dim()
        t.view(width)[index] += 1
    else:
        t[index] += 1
