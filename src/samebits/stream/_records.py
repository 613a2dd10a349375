"""The records of a STEP frame, decoded: `Record` (identified by kind, phase, name and
occurrence, never by position) and `parse_records`, which checks every field.  No torch but
for the rare metric dtypes (float8, complex).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from struct import error as struct_error

from samebits.fingerprint import DTYPE_CODE_BY_NAME, ITEMSIZE_BY_NAME
from samebits.stream import _format as fmt
from samebits.verdicts import ToDict

_DTYPE_NAMES = {code: name for name, code in DTYPE_CODE_BY_NAME.items()}
_DTYPE_NAMES[0] = "none"  # an absent tensor (None)
_ITEMSIZES = {code: ITEMSIZE_BY_NAME[name] for name, code in DTYPE_CODE_BY_NAME.items()}
# A metric's bits as a Python number, without torch: struct's formats (little-endian, as written);
# bfloat16 is the top half of a float32.  Other dtypes (float8, complex) are decoded by torch.
_STRUCT_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                   "int8": "<b", "uint8": "<B", "uint16": "<H", "uint32": "<I", "uint64": "<Q", "bool": "<?"}


class _Malformed(Exception):
    """Internal: a frame's bytes do not parse; turned into a StreamError naming the frame."""


class _NewerWriter(Exception):
    """Internal: a record of a kind this samebits does not know (a newer writer's)."""


def _dtype_name(code: int) -> str:
    name = _DTYPE_NAMES.get(code)
    if name is None:
        raise _Malformed(f"unknown dtype code {code} (written by a newer samebits?)")
    return name


def _fast_varint(buf, pos: int) -> tuple[int, int]:
    """`decode_varint` with a one-byte fast path; IndexError/ValueError on bad input (the
    frame walk turns them into a StreamError naming the frame)."""
    byte = buf[pos]
    if byte < 0x80:
        return byte, pos + 1
    return fmt.decode_varint(buf, pos)


def _varint(buf, pos: int, end: int) -> tuple[int, int]:
    try:
        return fmt.decode_varint(buf, pos, end)
    except (IndexError, ValueError) as err:
        raise _Malformed(f"bad varint at payload byte {pos}: {err}") from None


@dataclass(frozen=True)
class Record(ToDict):
    """One decoded record.  Identity is (phase, name, occurrence, kind), never position."""

    kind: str  # "tensor" | "metric"
    phase: str
    name: str
    occurrence: int
    dtype: str
    shape: tuple[int, ...] | None  # None for metrics
    flags: int
    digest: int | None  # tensors: the 64-bit digest (None if absent or capped)
    raw: bytes | None  # metrics: the exact bits of the value

    @property
    def key(self) -> tuple:
        return (self.kind, self.phase, self.name, self.occurrence)

    @property
    def absent(self) -> bool:
        return bool(self.flags & fmt.FLAG_ABSENT)

    @property
    def capped(self) -> bool:
        return bool(self.flags & fmt.FLAG_CAPPED)

    @property
    def value(self):
        """A metric's value as a Python number (exact: decoded from the stored bits)."""
        if self.raw is None:
            return None
        try:
            if self.dtype in _STRUCT_FORMATS:
                return struct.unpack(_STRUCT_FORMATS[self.dtype], self.raw)[0]
            if self.dtype == "bfloat16":
                return struct.unpack("<f", b"\x00\x00" + bytes(self.raw))[0]
            import torch  # the rarer dtypes (float8, complex): torch decodes them, as it encoded them

            data = torch.frombuffer(bytearray(self.raw), dtype=torch.uint8)
            return data.view(getattr(torch, self.dtype)).item()
        except (AttributeError, RuntimeError, TypeError, ValueError, struct_error):
            return None  # a dtype without a Python scalar (e.g. packed 4-bit): `bits` is exact

    def same_content(self, other: "Record") -> bool:
        return (self.dtype, self.shape, self.flags, self.digest, self.raw) == \
            (other.dtype, other.shape, other.flags, other.digest, other.raw)

    def summary(self) -> str:
        """A short text of what the record holds: shape/dtype/digest or the metric value."""
        if self.kind == "metric":
            return f"{self.value!r} ({self.dtype} 0x{bytes(self.raw)[::-1].hex()})"
        shape = "x".join(map(str, self.shape)) if self.shape else "scalar"
        if self.absent:
            return "None"
        digest = "capped (no digest)" if self.capped else f"{self.digest:016x}"
        return f"{shape} {self.dtype} {digest}"

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "phase": self.phase, "name": self.name, "occurrence": self.occurrence,
               "dtype": self.dtype}
        if self.kind == "metric":
            out["value"] = self.value
            out["bits"] = "0x" + self.raw[::-1].hex()
        else:
            out["shape"] = list(self.shape)
            out["numel"] = math.prod(self.shape)
            out["digest"] = None if self.digest is None else f"{self.digest:016x}"
            if self.absent:
                out["absent"] = True
            if self.capped:
                out["capped"] = True
        return out


def parse_records(payload: bytes, pos: int, count: int, names: list[str], names_count: int, *,
                  writer: str | None = None, canonical: bool = False, may_cap: bool = True):
    """Decode ``count`` records from ``payload[pos:]``, checking every field as docs/stream.md
    ("Byte layout") requires; with ``canonical`` return the schema-1 root input instead.
    ``names[:names_count]`` are the names known at this step; ``writer`` (the header's samebits
    version) is named when a record is of an unknown kind."""
    size, records, out, seen = len(payload), [], bytearray(), set()

    def name(ident: int) -> str:
        if ident >= names_count:
            raise _Malformed(f"name id {ident} was never interned ({names_count} names)")
        return names[ident]

    for index in range(count):
        if pos >= size:
            raise _Malformed(f"record {index} of {count} starts past the end of the frame")
        kind = payload[pos]
        length, pos = _varint(payload, pos + 1, size)
        end = pos + length
        if end > size:
            raise _Malformed(f"record {index} of {count} runs past the end of the frame")
        if kind not in (fmt.RECORD_TENSOR, fmt.RECORD_METRIC):
            raise _NewerWriter(
                f"record {index} of {count} is of kind {kind}, which this samebits does not know: the stream "
                f"was written by a newer samebits (its header says samebits {str(writer):.40}) "
                "or is corrupt. Compare it with the samebits version that wrote it.")
        phase_id, pos = _varint(payload, pos, end)
        name_id, pos = _varint(payload, pos, end)
        phase, label = name(phase_id), name(name_id)
        if canonical:
            out += bytes((kind,)) + phase.encode() + b"\0" + label.encode() + b"\0" + payload[pos:end]
        occurrence, pos = _varint(payload, pos, end)
        identity = (kind, phase, label, occurrence)  # by text: a name table may hold a name twice
        if identity in seen:
            raise _Malformed(f"record {index} ({phase}/{label}, occurrence {occurrence}) repeats an identity "
                             "already in the step (a writer gives each one its own occurrence)")
        seen.add(identity)
        if pos >= end:
            raise _Malformed(f"record {index} ({phase}/{label}) ends before its dtype")
        code = payload[pos]
        dtype = _dtype_name(code)
        pos += 1
        if kind == fmt.RECORD_TENSOR:
            if pos + 2 > end:
                raise _Malformed(f"record {index} ({phase}/{label}) ends before its shape")
            flags, ndim = payload[pos], payload[pos + 1]
            pos += 2
            if flags & ~(fmt.FLAG_ABSENT | fmt.FLAG_CAPPED) or (code == 0) != bool(flags & fmt.FLAG_ABSENT) \
                    or flags == fmt.FLAG_ABSENT | fmt.FLAG_CAPPED:
                raise _Malformed(f"record {index} ({phase}/{label}) has flags {flags} with dtype {dtype}")
            if flags & fmt.FLAG_CAPPED and not may_cap:
                raise _Malformed(f"record {index} ({phase}/{label}) is flagged over the size cap, but its "
                                 "segment's header declares no cap")
            shape = []
            for _ in range(ndim):
                dim, pos = _varint(payload, pos, end)
                shape.append(dim)
            digest = None
            if not flags & (fmt.FLAG_ABSENT | fmt.FLAG_CAPPED):
                if pos + 8 > end:
                    raise _Malformed(f"record {index} ({phase}/{label}) ends before its digest")
                digest = fmt.unpack_u64(payload, pos)
                pos += 8
            if pos != end:
                raise _Malformed(f"record {index} ({phase}/{label}) has {end - pos} stray bytes")
            records.append(Record("tensor", phase, label, occurrence, dtype, tuple(shape), flags, digest, None))
        else:
            raw = bytes(payload[pos:end])
            if code == 0 or len(raw) != _ITEMSIZES.get(code):
                raise _Malformed(f"metric {index} ({phase}/{label}) holds {len(raw)} bytes for dtype {dtype}")
            records.append(Record("metric", phase, label, occurrence, dtype, None, 0, None, raw))
        pos = end
    if pos != size:
        raise _Malformed(f"{size - pos} bytes after the last of {count} records")
    return out if canonical else records
