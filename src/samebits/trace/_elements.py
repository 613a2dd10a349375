"""Element detail of a divergence: which elements of two tensors differ (NaN payloads by their
bits), and by how many ulps (`samebits._torchutil.ordered_bits`: +0 and -0 are 0 ulps apart).
"""

from __future__ import annotations

import torch

from samebits._torchutil import int_view, ordered_bits


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """Floats as int64 in value order (one step per ulp); integers and bools as int64."""
    if t.is_floating_point():
        return ordered_bits(int_view(t).to(torch.int64), 8 * t.element_size())
    return t.to(torch.int64)


def _bitwise_unequal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
        return _bitwise_unequal(a, b).any(dim=-1)
    if a.is_floating_point():
        return int_view(a) != int_view(b)
    return a != b


def compare_elements(a: torch.Tensor, b: torch.Tensor, *, max_indices: int = 5) -> dict:
    """How `a` and `b` (same shape and dtype) differ element by element: counts, max ulp, and
    ``values`` (``index``, ``a``, ``b``, ``ulp``) of the first differing elements, row-major."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"differing": None, "total": a.numel(), "max_ulp": None, "first_indices": [], "values": [],
                "shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch."),
                "note": f"shapes/dtypes differ: {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"}
    a, b = a.detach().cpu(), b.detach().cpu()
    unequal = _bitwise_unequal(a, b).reshape(-1)
    differing = int(unequal.sum())
    flat_positions = unequal.nonzero().flatten()[:max_indices].tolist()
    max_ulp, values = 0, []
    if differing:
        if a.is_complex():
            ulps = (_ordered(torch.view_as_real(a)) - _ordered(torch.view_as_real(b))).abs().amax(dim=-1)
        elif a.dtype is torch.bool:
            ulps = (a != b).to(torch.int64)
        else:
            ulps = (_ordered(a).to(torch.float64) - _ordered(b).to(torch.float64)).abs()
        ulps = ulps.reshape(-1)
        max_ulp = int(ulps.max())
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        for position in flat_positions:
            index = list(torch.unravel_index(torch.tensor(position), a.shape)) if a.dim() else []
            values.append({"index": [int(i) for i in index],
                           "a": _py(flat_a[position]), "b": _py(flat_b[position]),
                           "ulp": int(ulps[position])})
    return {
        "differing": differing,
        "total": a.numel(),
        "max_ulp": max_ulp,
        "first_indices": [v["index"] for v in values],
        "values": values,
        "shape": list(a.shape),
        "dtype": str(a.dtype).removeprefix("torch."),
    }


def _py(value: torch.Tensor):
    item = value.item()
    return repr(item) if isinstance(item, complex) else item


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when `a` and `b` hold the same multiset of element bit patterns (one is a
    permutation of the other): "same values, different order"."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    if a.dtype is torch.bool:
        a, b = a.to(torch.int8), b.to(torch.int8)
    if a.is_floating_point():  # sort bit patterns, so -0/+0 and NaN payloads count as distinct values
        a, b = int_view(a), int_view(b)
    return torch.equal(torch.sort(a).values, torch.sort(b).values)
