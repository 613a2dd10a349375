"""Exact distances between recorded float values, from their stored bits: units in the last
place (how many representable values apart) and the relative difference.  `samebits report`
shows them for differing metrics, `samebits matrix` for layouts that do not agree."""

from __future__ import annotations

import math
import struct

from samebits._torchutil import ordered_bits
from samebits.stream import Record

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")  # the dtypes an ulp count is defined for
_FLOAT_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e"}


def ulp_distance(dtype: str, raw_a: bytes, raw_b: bytes) -> int | None:
    """How many representable ``dtype`` values lie between two values' bits, or None where
    that means nothing (not a float dtype, bits of different widths)."""
    if dtype not in FLOAT_DTYPES or len(raw_a) != len(raw_b):
        return None
    a, b = (ordered_bits(int.from_bytes(raw, "little"), 8 * len(raw)) for raw in (raw_a, raw_b))
    return abs(a - b)


def float_value(record: Record) -> float | None:
    """A metric's value as a Python float from its exact bits (None: not a number)."""
    if record.raw is None:
        return None
    fmt = _FLOAT_FORMATS.get(record.dtype)
    if fmt is not None:
        return struct.unpack(fmt, bytes(record.raw))[0]
    value = record.value
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def metric_distance(a: Record, b: Record) -> tuple[int | None, float | None]:
    """(ulps, relative difference) between two float metrics from their exact bits, or None
    for what is not defined (different dtypes, non-float metrics, non-finite values)."""
    if a.raw is None or b.raw is None or a.dtype != b.dtype or len(a.raw) != len(b.raw):
        return None, None
    value_a, value_b = float_value(a), float_value(b)
    if value_a is None or value_b is None or not (math.isfinite(value_a) and math.isfinite(value_b)):
        return None, None  # an ulp count across inf/nan or for non-floats means nothing
    ulp = ulp_distance(a.dtype, a.raw, b.raw)
    scale = max(abs(value_a), abs(value_b))
    relative = 0.0 if value_a == value_b else (abs(value_a - value_b) / scale if scale else None)
    return ulp, relative


__all__ = ["FLOAT_DTYPES", "ulp_distance", "float_value", "metric_distance"]
