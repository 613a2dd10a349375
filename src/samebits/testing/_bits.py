"""Bit-for-bit comparison of nested structures of tensors, and the message that explains a miss:
exact bytes (strides ignored, -0.0 differs from 0.0, NaN payloads count), the value's pytree
path, the first differing indices with both bit patterns, and the distance in ulps.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping
from typing import Any

import torch

from samebits._torchutil import int_view, ordered_bits

_MAX_INDICES = 4  # differing elements shown per leaf
_MAX_LEAVES = 8  # differing leaves listed in one message


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One compared value: a tensor's bits on the CPU (row-major), or a plain Python value."""

    path: str
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    data: Any  # torch.Tensor (CPU, contiguous, detached) or a Python value

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """How two leaves at one path differ."""

    path: str
    summary: str  # one line: what differs
    details: tuple[str, ...] = ()  # the first differing elements, one line each


def flatten(value: Any, path: str) -> list[Leaf]:
    """The leaves of a nested structure with their paths; tensors copied to the CPU as they are now."""
    leaves: list[Leaf] = []
    _flatten(value, path, leaves)
    return leaves


def members(value: Any, path: str) -> list[tuple[Any, str]] | None:
    """(item, its path) for each member of a container or dataclass; None for a leaf."""
    if isinstance(value, Mapping):
        return [(value[key], f"{path}[{key!r}]") for key in value]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return [(getattr(value, name), f"{path}.{name}") for name in value._fields]
    if isinstance(value, (list, tuple)):
        return [(item, f"{path}[{index}]") for index, item in enumerate(value)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(getattr(value, f.name), f"{path}.{f.name}") for f in dataclasses.fields(value)]
    return None


def _flatten(value: Any, path: str, out: list[Leaf]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(tensor_leaf(value, path))
    elif (items := members(value, path)) is not None:
        for item, item_path in items:
            _flatten(item, item_path, out)
    else:
        out.append(Leaf(path, None, None, _plain(value)))


def _plain(value: Any) -> Any:
    """Python floats by their bits (so -0.0 != 0.0 and NaN payloads count), the rest as is."""
    if isinstance(value, float):
        return ("float64 bits", struct.pack("<d", value).hex())
    return value


def tensor_leaf(tensor: torch.Tensor, path: str) -> Leaf:
    """A tensor's logical contents as a CPU (numel, element size) uint8 copy."""
    t = tensor.detach()
    if t.layout != torch.strided or t.is_nested:
        raise TypeError(f"{path}: a {t.layout} tensor; samebits.testing compares dense tensors "
                        "(compare t.to_dense() or its components)")
    t = t.resolve_conj().resolve_neg()
    # the integer view: a plain bit copy below, also for dtypes without a copy kernel
    data = int_view(t).cpu().contiguous().reshape(-1).view(torch.uint8).view(-1, t.element_size()).clone()
    return Leaf(path, tensor.dtype, tuple(tensor.shape), data)


def leaf_bytes(leaf: Leaf) -> bytes:
    """The exact bytes of a tensor leaf (row-major)."""
    return leaf.data.numpy().tobytes()


def compare(a: list[Leaf], b: list[Leaf]) -> list[Mismatch]:
    """Every difference between two flattened structures, in path order of ``a``."""
    by_path = {leaf.path: leaf for leaf in b}
    mismatches = []
    for leaf in a:
        other = by_path.pop(leaf.path, None)
        if other is None:
            mismatches.append(Mismatch(leaf.path, "present in the first, missing in the second"))
            continue
        found = compare_leaf(leaf, other)
        if found is not None:
            mismatches.append(found)
    mismatches.extend(Mismatch(path, "missing in the first, present in the second") for path in by_path)
    return mismatches


def compare_leaf(a: Leaf, b: Leaf) -> Mismatch | None:
    if a.is_tensor != b.is_tensor:
        kinds = ["a tensor" if leaf.is_tensor else type(leaf.data).__name__ for leaf in (a, b)]
        return Mismatch(a.path, f"{kinds[0]} vs {kinds[1]}")
    if not a.is_tensor:
        if type(a.data) is type(b.data) and a.data == b.data:
            return None
        return Mismatch(a.path, f"{_show_plain(a.data)} vs {_show_plain(b.data)}")
    if a.dtype != b.dtype:
        return Mismatch(a.path, f"dtype {a.dtype} vs {b.dtype}")
    if a.shape != b.shape:
        return Mismatch(a.path, f"shape {list(a.shape)} vs {list(b.shape)}")
    if leaf_bytes(a) == leaf_bytes(b):
        return None
    return _describe(a, b)


def _show_plain(value: Any) -> str:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "float64 bits":
        return f"{struct.unpack('<d', bytes.fromhex(value[1]))[0]!r} [0x{value[1]}]"
    return repr(value)


def _describe(a: Leaf, b: Leaf) -> Mismatch:
    """The differing elements of two same-shaped tensors of one dtype."""
    positions = a.data.ne(b.data).any(dim=1).nonzero().flatten().tolist()
    numel = a.data.shape[0]
    summary = f"{len(positions)} of {numel} element(s) differ ({a.dtype}, shape {list(a.shape)})"
    details = []
    for position in positions[:_MAX_INDICES]:
        value_a, bits_a = _element(a, position)
        value_b, bits_b = _element(b, position)
        details.append(f"at {_unravel(position, a.shape)}: {value_a} [{bits_a}] vs {value_b} [{bits_b}]"
                       f"{_ulp_note(a.dtype, int(bits_a, 16), int(bits_b, 16), value_a, value_b)}")
    if len(positions) > _MAX_INDICES:
        details.append(f"... and {len(positions) - _MAX_INDICES} more")
    return Mismatch(a.path, summary, tuple(details))


def _unravel(position: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(position % size)
        position //= size
    return tuple(reversed(index))


def _element(leaf: Leaf, position: int) -> tuple[str, str]:
    """(value as text, bit pattern as hex) of one element."""
    raw = leaf.data[position]  # (element size,) uint8
    pattern = int.from_bytes(raw.numpy().tobytes(), "little")
    try:
        value = raw.view(leaf.dtype)
        if leaf.dtype.is_floating_point and leaf.dtype.itemsize == 1:  # float8: no .item() on some builds
            value = value.to(torch.float32)
        shown = repr(value.item())
    except (RuntimeError, TypeError):  # shell dtypes (uint4, ...) have no scalar value
        shown = "?"
    return shown, f"0x{pattern:0{2 * raw.numel()}x}"


def _ulp_note(dtype: torch.dtype, a: int, b: int, value_a: str, value_b: str) -> str:
    """The distance in units in the last place, for floating dtypes (signed zeros and NaNs named)."""
    if not dtype.is_floating_point:
        return ""
    if value_a == value_b == "nan":
        return " (both NaN: different payloads)"
    if {value_a, value_b} == {"0.0", "-0.0"}:
        return " (signed zeros: +0 and -0)"
    if "nan" in (value_a, value_b):
        return " (one is NaN)"
    width = dtype.itemsize * 8
    return f" ({abs(ordered_bits(a, width) - ordered_bits(b, width))} ulp)"


def render(mismatches: list[Mismatch], *, header: str) -> str:
    lines = [header]
    for mismatch in mismatches[:_MAX_LEAVES]:
        lines.append(f"  {mismatch.path}: {mismatch.summary}")
        lines.extend(f"      {line}" for line in mismatch.details)
    if len(mismatches) > _MAX_LEAVES:
        lines.append(f"  ... and {len(mismatches) - _MAX_LEAVES} more differing value(s)")
    return "\n".join(lines)
