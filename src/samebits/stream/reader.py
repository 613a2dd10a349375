"""Reading fingerprint streams: one rank (`StreamReader`) or a whole run directory (`Run`).

Nothing read is trusted: every frame's checksum is checked, every step root is recomputed
from the step's records, the step-index footer must agree with the steps read, and any
malformed byte is a `StreamError` naming the file, the byte offset and the frame.  Reading
is streaming (the file is memory-mapped, a step's records are decoded only when asked for),
so memory stays flat however long the run.  A stream cut short by a killed writer reads
back every complete frame, and `StreamReader.stop_reason` says where and why reading
stopped.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import stat
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from struct import error as struct_error
from typing import Iterator

import numpy as np

from samebits.fingerprint import DIGEST_VERSION, DTYPE_CODE_BY_NAME, ITEMSIZE_BY_NAME
from samebits.errors import IncomparableRunsError, StreamError
from samebits.stream import _format as fmt
from samebits.verdicts import ToDict

_STREAM_RE = re.compile(r"^rank-(\d{5,})\.sbs$")
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODE_BY_NAME.items()}
_DTYPE_NAMES[0] = "none"  # an absent tensor (None)
_ITEMSIZES = {code: ITEMSIZE_BY_NAME[name] for name, code in DTYPE_CODE_BY_NAME.items()}
# A metric's bits as a Python number, without torch: struct's formats (little-endian, as written);
# bfloat16 is the top half of a float32.  Other dtypes (float8, complex) are decoded by torch.
_STRUCT_FORMATS = {"float64": "<d", "float32": "<f", "float16": "<e", "int64": "<q", "int32": "<i", "int16": "<h",
                   "int8": "<b", "uint8": "<B", "uint16": "<H", "uint32": "<I", "uint64": "<Q", "bool": "<?"}
_CORRUPT_HINT = ("Every frame before that byte is intact: compare up to the step before it "
                 "(--to-step), or re-record the run.")


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
        return (
            self.dtype == other.dtype
            and self.shape == other.shape
            and self.flags == other.flags
            and self.digest == other.digest
            and self.raw == other.raw
        )

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
            out["numel"] = _numel(self.shape)
            out["digest"] = None if self.digest is None else f"{self.digest:016x}"
            if self.absent:
                out["absent"] = True
            if self.capped:
                out["capped"] = True
        return out


def _numel(shape) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


@dataclass(slots=True)
class StepBlock:
    """One step of one rank: checksum and root already verified, records not yet decoded."""

    step: int
    num_records: int
    root: int  # recomputed from the records and equal to the stored root
    reader: "StreamReader"
    offset: int  # where the frame starts in the file
    names_count: int  # how many names were interned before this block
    schema: int = fmt.SCHEMA_VERSION  # of the segment holding the step (decides the root encoding)
    names_key: bytes = field(default=b"", repr=False)  # the names key of the step root (schema 2)
    # Whether the segment's header declares a size cap (``max_tensor_bytes``): only then may
    # the step hold capped records (shape and dtype, no digest), compared by shape only.
    may_cap: bool = False

    def records(self) -> list[Record]:
        return self.reader.decode(self)


def _file_type(mode: int) -> str:
    for check, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if check(mode):
            return name
    return "not a regular file"


class StreamReader:
    """Sequential, verifying reader of one rank's stream file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.names: list[str] = []
        self.segments: list[dict] = []
        self.stop_reason: str | None = None
        self.closed_cleanly = False
        self.end_offset = 0  # the end of the last complete frame
        self._data = b""
        try:
            # O_NONBLOCK: a FIFO in place of a stream must not block the open; the opened file
            # itself is then checked (no window between a check and the open)
            descriptor = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with open(descriptor, "rb") as file:
                status = os.fstat(file.fileno())
                if not stat.S_ISREG(status.st_mode):
                    raise StreamError(f"{self.path}: not a regular file ({_file_type(status.st_mode)}); a "
                                      "fingerprint stream is a regular rank-NNNNN.sbs file written by samebits.")
                self.size = status.st_size
                if self.size:
                    self._data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise StreamError(f"{self.path}: no such stream file.") from None
        except PermissionError:
            raise StreamError(f"{self.path}: permission denied; make the stream readable "
                              f"(e.g. chmod a+r {self.path}) and retry.") from None
        except IsADirectoryError:
            raise StreamError(f"{self.path}: a directory, not a stream file; pass the run directory that holds "
                              "it, or the rank-NNNNN.sbs file itself.") from None
        except (OSError, ValueError) as err:
            raise StreamError(f"{self.path}: cannot read the stream ({err}).") from None
        self.size = len(self._data)
        self._pos = 0
        self._torn_scans: dict[int, int | None] = {}  # offset -> `_valid_frame_after` (computed once)
        self._tail_closed = self._ends_with_close_frame()
        self._reset_state()
        try:
            first = self._next_frame()
        except StreamError as err:
            raise StreamError(f"{self.path}: not a samebits stream ({err}).") from None
        if first is None or first[0] != fmt.FRAME_HEADER:
            raise StreamError(
                f"{self.path}: not a samebits stream (no header frame at byte 0"
                + (f"; {self.stop_reason}" if self.stop_reason else "")
                + "). Was it written by samebits.Recorder?"
            )
        self.header = self._header(first)
        self._first_end = self._pos

    def _reset_state(self) -> None:
        self._names_hasher = fmt.new_names_hasher()
        self._names_key = self._names_hasher.digest()
        self._expected_index = bytearray()  # what the INDEX footer must hold (about 14 bytes per step)
        self._num_steps = 0
        self._last_step: int | None = None
        self._last_kind: int | None = None
        self._last_offset = 0
        self._schema = fmt.SCHEMA_VERSION
        self._may_cap = False

    @property
    def digest_version(self) -> int:
        """The version of the digest this stream's digests were computed with (docs/digest.md)."""
        return fmt.digest_version_of(self.header)

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def rank(self) -> int:
        return self.header["rank"]

    # -- errors -------------------------------------------------------------------------

    def _where(self, kind: int | None, offset: int) -> str:
        what = f"the {fmt.FRAME_KINDS.get(kind, 'unknown')} frame at byte {offset} (of {self.size})"
        if self._last_step is not None:
            what += f", after step {self._last_step}"
        return what

    def _corrupt(self, kind: int | None, offset: int, problem: str) -> StreamError:
        return StreamError(f"{self.path}: {problem} in {self._where(kind, offset)}: the file is corrupt. "
                           + _CORRUPT_HINT)

    # -- frames -------------------------------------------------------------------------

    def _ends_with_close_frame(self) -> bool:
        """Whether the file's last bytes are a valid CLOSE frame: then its writer finished,
        and a frame that runs past the end is damage, not a killed writer's torn write."""
        size = fmt.CLOSE_FRAME_SIZE
        if self.size < size:
            return False
        tail = self._data[self.size - size:]
        return (tail[0] == fmt.FRAME_CLOSE and tail[1] == 16 and tail[10:18] == fmt.CLOSE_MAGIC
                and zlib.crc32(tail[:18]) == fmt.unpack_u32(tail, 18))

    def _next_frame(self):
        """(kind, offset, payload bytes) of the next frame, checksum verified; None at the
        end of the file (with `stop_reason` set when the end is not a clean close)."""
        data, offset, size = self._data, self._pos, self.size
        if offset >= size:
            if not self.closed_cleanly and self.stop_reason is None:
                self.stop_reason = f"ended without a close frame at byte {offset} (writer killed, or still running)"
            return None
        kind = data[offset]
        if kind not in fmt.FRAME_KINDS:
            raise StreamError(
                f"{self.path}: unknown frame kind {kind} at byte {offset} (of {size})"
                + (f", after step {self._last_step}" if self._last_step is not None else "")
                + ": the file is corrupt or was written by a newer samebits. " + _CORRUPT_HINT
            )
        try:
            if offset + 1 < size and data[offset + 1] < 0x80:
                length, start = data[offset + 1], offset + 2
            else:
                length, start = fmt.decode_varint(data, offset + 1, min(size, offset + 11))
        except IndexError:
            return self._torn(kind, offset, "an incomplete frame header")
        except ValueError:
            raise self._corrupt(kind, offset, "an invalid length field") from None
        end = start + length + 4
        if end > size:
            return self._torn(kind, offset, f"a {fmt.FRAME_KINDS[kind]} frame of {length} bytes")
        payload = data[start : start + length]
        if zlib.crc32(payload, zlib.crc32(data[offset:start])) != fmt.unpack_u32(data, start + length):
            raise self._corrupt(kind, offset, "checksum mismatch")
        self._pos = self.end_offset = end
        self.closed_cleanly = False
        return kind, offset, payload

    def _torn(self, kind: int, offset: int, what: str):
        """The frame at ``offset`` runs past the end of the file: a killed writer's torn last
        write, unless the file shows that more data follows (then it is damage)."""
        if self._tail_closed:
            raise self._corrupt(kind, offset, f"{what} runs past the end of the file although the stream "
                                "ends in a valid close frame (its length field is damaged)")
        following = self._valid_frame_after(offset)
        if following is not None:
            raise self._corrupt(kind, offset, f"{what} runs past the end of the file although a valid "
                                f"frame follows at byte {following} (its length field is damaged)")
        self.stop_reason = (
            f"truncated at byte {offset} of {self.size}: {what} was cut short (writer killed "
            "mid-write); every complete record before it was read"
        )
        unchecked = self._torn_scans.get(offset, (None, 0))[1]
        if unchecked:
            self.stop_reason += (f" (the bounded scan after it left {unchecked} possible frame(s) unchecked, so "
                                 "a damaged length field cannot be ruled out)")
        self._pos = self.size
        return None

    # The torn-frame scan (`_valid_frame_after`): how far after a frame that runs past the end
    # it looks for a complete frame, and how much checksumming it may spend there.  Both are
    # linear in the bytes scanned, so a crafted tail cannot make a read quadratic.
    TORN_SCAN_BYTES = 1 << 20
    TORN_SCAN_CHECKSUM_FACTOR = 32  # checksummed bytes <= this x the bytes scanned, + TORN_SCAN_BYTES
    TORN_SCAN_CANDIDATES = 1 << 16  # frames checksummed at most

    def _valid_frame_after(self, offset: int) -> int | None:
        """A byte after ``offset`` (within `TORN_SCAN_BYTES`) where a complete frame with a valid
        checksum starts, or None.  A torn write leaves nothing complete after it.  Candidates
        (a frame kind, a length that ends inside the file) are found in one vectorised pass and
        checksummed cheapest first within a budget linear in the bytes scanned; what the
        budget leaves unchecked is counted (`_torn` says so).  Memoised per offset."""
        if offset not in self._torn_scans:
            self._torn_scans[offset] = self._scan_for_frame(offset)
        return self._torn_scans[offset][0]

    def _scan_for_frame(self, offset: int) -> tuple[int | None, int]:
        """(`_valid_frame_after`, how many candidates the budget left unchecked)."""
        data, size = self._data, self.size
        first, stop = offset + 1, min(size, offset + self.TORN_SCAN_BYTES)
        if stop <= first:
            return None, 0
        window = np.frombuffer(data, dtype=np.uint8, count=min(size, stop + 11) - first, offset=first).copy()
        kinds = window[: stop - first]
        candidates = np.flatnonzero(np.isin(kinds, np.array(sorted(fmt.FRAME_KINDS), dtype=np.uint8)))
        if not len(candidates):
            return None, 0
        bytes_ = window.astype(np.int64)
        last = len(bytes_) - 1
        length = np.zeros(len(candidates), dtype=np.int64)
        payload_at = np.full(len(candidates), -1, dtype=np.int64)  # window-relative; -1: not decoded
        for i in range(5):  # varints of up to 5 bytes: lengths below 2**35
            at = candidates + 1 + i
            inside = at <= last
            byte = np.where(inside, bytes_[np.minimum(at, last)], 0x80)
            open_ = payload_at < 0
            length = np.where(open_, length | ((byte & 0x7F) << (7 * i)), length)
            ends = open_ & inside & (byte < 0x80)
            payload_at[ends] = at[ends] + 1
        frame_end = first + payload_at + length  # absolute: where the crc starts
        keep = (payload_at >= 0) & (frame_end + 4 <= size)
        candidates, frame_end = candidates[keep] + first, frame_end[keep]
        cost = frame_end - candidates
        order = np.argsort(cost, kind="stable")
        budget = self.TORN_SCAN_CHECKSUM_FACTOR * (stop - first) + self.TORN_SCAN_BYTES
        spent = checked = 0
        for index in order.tolist():
            spent += int(cost[index])
            if spent > budget or checked >= self.TORN_SCAN_CANDIDATES:
                return None, len(order) - checked
            checked += 1
            pos, end = int(candidates[index]), int(frame_end[index])
            if zlib.crc32(data[pos:end]) == fmt.unpack_u32(data, end):
                return pos, 0
        return None, 0

    def _header(self, frame) -> dict:
        _, offset, payload = frame
        if not payload.startswith(fmt.MAGIC):
            raise StreamError(f"{self.path}: header frame at byte {offset} lacks the samebits magic.")
        try:
            header = json.loads(payload[len(fmt.MAGIC):])
        except (ValueError, RecursionError) as err:
            raise StreamError(f"{self.path}: header at byte {offset} is not valid JSON ({err}).") from None
        if not isinstance(header, dict):
            raise StreamError(f"{self.path}: header at byte {offset} is not a JSON object: the file is corrupt.")
        if header.get("schema") not in fmt.READABLE_SCHEMAS:
            raise StreamError(
                f"{self.path}: stream schema version {header.get('schema')!r}, this samebits reads "
                f"versions {', '.join(map(str, fmt.READABLE_SCHEMAS))}. Read it with the samebits version that "
                f"wrote it ({header.get('samebits', 'unknown')!s:.40})."
            )
        problems = []
        for key, minimum in (("rank", 0), ("world_size", 1)):
            value = header.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                problems.append(f"{key} = {value!r:.40}")
        if not problems and header["rank"] >= header["world_size"]:
            problems.append(f"rank {header['rank']} outside world size {header['world_size']}")
        for key in ("config", "environment", "coords"):
            if not isinstance(header.get(key, {}), dict):
                problems.append(f"{key} is not an object")
        version = fmt.digest_version_of(header)
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            problems.append(f"{fmt.DIGEST_VERSION_KEY} = {version!r:.40}")
        if self.segments and not problems:
            first = self.segments[0]
            if (header["rank"], header["world_size"]) != (first["rank"], first["world_size"]):
                problems.append(f"segment of rank {header['rank']}/{header['world_size']} appended to a stream "
                                f"of rank {first['rank']}/{first['world_size']}")
            elif version != fmt.digest_version_of(first):
                raise StreamError(f"{self.path}: the segment at byte {offset} has digest version {version}, appended "
                                  f"to a stream of digest version {fmt.digest_version_of(first)} (by an older "
                                  "samebits resuming it?): their digests cannot be compared with each other. "
                                  "Re-record the run with one samebits version.")
        if problems:
            raise StreamError(f"{self.path}: header at byte {offset} is invalid ({'; '.join(problems)}): the file "
                              "is corrupt or was not written by samebits.Recorder.")
        self.segments.append(header)
        self._schema = header["schema"]
        self._may_cap = header.get("max_tensor_bytes") is not None
        return header

    def steps(self, verify: bool = False) -> Iterator[StepBlock]:
        """Yield the steps in order, each frame's checksum and each step's root verified.
        (``verify`` is kept for compatibility: every read is verified now.)"""
        for frame in self.step_frames():
            self.check_root(*frame)
            yield frame[0]

    def step_frames(self, defer_checksums: bool = False) -> Iterator[tuple[StepBlock, bytes, int, tuple | None]]:
        """Yield (block, frame payload, where its records start, pending) for each step in
        order, the structure and the step-index footer checked but the step roots not yet
        recomputed: call ``check_root(*frame)`` on each before using it.  ``block.root`` is
        the stored root.  With ``defer_checksums`` the checksum of a step frame is checked
        by `check_root` too (``pending`` holds the frame head and stored CRC; otherwise
        None): a comparer that finds two frames byte-equal checks and hashes them once."""
        self._pos = self._first_end
        self.segments = self.segments[:1]
        self._schema = self.header["schema"]
        self.names = []
        self.stop_reason = None
        self.closed_cleanly = False
        self._reset_state()
        self._schema = self.header["schema"]
        self._may_cap = self.header.get("max_tensor_bytes") is not None
        self._last_kind = fmt.FRAME_HEADER
        data, size, crc32 = self._data, self.size, zlib.crc32
        unpack_u32, unpack_u64 = fmt._U32.unpack_from, fmt._U64.unpack_from
        expected = self._expected_index
        STEP = fmt.FRAME_STEP
        while True:
            # Fast path, the bulk of every stream: a complete step frame with a short length
            # field.  Anything else (other kinds, a torn or damaged frame) goes the general way.
            offset = self._pos
            if (offset + 3 < size and data[offset] == STEP and self._last_kind != fmt.FRAME_CLOSE
                    and data[offset + 1] & 0x80 and data[offset + 2] & 0x80 == 0):
                start = offset + 3
                end = start + (data[offset + 1] & 0x7F | data[offset + 2] << 7)
                if end + 4 <= size:
                    payload = data[start:end]
                    pending = (data[offset:start], unpack_u32(data, end)[0])
                    if not defer_checksums:
                        if crc32(payload, crc32(pending[0])) != pending[1]:
                            raise self._corrupt(STEP, offset, "checksum mismatch")
                        pending = None
                    self._pos = self.end_offset = end + 4
                    self.closed_cleanly = False
                    self._last_kind, self._last_offset = STEP, offset
                    try:
                        step, pos = _fast_varint(payload, 0)
                        count, pos = _fast_varint(payload, pos)
                        stored = unpack_u64(payload, pos)[0]
                    except (IndexError, ValueError, struct_error) as err:
                        self._check_crc(offset, payload, pending)  # damage first, if that is what it is
                        raise self._corrupt(STEP, offset, f"a malformed step frame ({err})") from None
                    if self._last_step is not None and step <= self._last_step:
                        self._check_crc(offset, payload, pending)
                        raise self._corrupt(STEP, offset, f"step {step} follows step {self._last_step}; "
                                            "steps must increase")
                    self._last_step = step
                    self._num_steps += 1
                    expected += payload[: pos + 8]
                    value = offset
                    while value > 0x7F:
                        expected.append((value & 0x7F) | 0x80)
                        value >>= 7
                    expected.append(value)
                    yield (StepBlock(step, count, stored, self, offset, len(self.names), self._schema, self._names_key,
                                     self._may_cap), payload, pos + 8, pending)
                    continue
            frame = self._next_frame()
            if frame is None:
                return
            kind, offset, payload = frame
            after_close = self._last_kind == fmt.FRAME_CLOSE
            previous_kind, previous_offset = self._last_kind, self._last_offset
            self._last_kind, self._last_offset = kind, offset
            if after_close and kind != fmt.FRAME_HEADER:
                raise self._corrupt(kind, offset, "a frame after the close frame that is not a new segment's header")
            try:
                if kind == fmt.FRAME_STEP:
                    yield self._step(payload, offset)
                    continue
                if kind == fmt.FRAME_NAMES:
                    self._add_names(payload)
                elif kind == fmt.FRAME_HEADER:
                    self._header(frame)
                elif kind == fmt.FRAME_INDEX:
                    self._check_index(payload)
                elif kind == fmt.FRAME_CLOSE:
                    if len(payload) != 16 or previous_kind != fmt.FRAME_INDEX \
                            or fmt.unpack_u64(payload, 0) != previous_offset or payload[8:] != fmt.CLOSE_MAGIC:
                        raise _Malformed("the close frame does not point at the step index just before it")
                    self.closed_cleanly = True
            except _Malformed as err:
                raise self._corrupt(kind, offset, str(err)) from None
            except (IndexError, ValueError, struct_error) as err:
                raise self._corrupt(kind, offset, f"a malformed {fmt.FRAME_KINDS[kind]} frame ({err})") from None

    def _step(self, payload: bytes, offset: int) -> tuple[StepBlock, bytes, int]:
        size = len(payload)
        step, pos = _fast_varint(payload, 0)
        count, pos = _fast_varint(payload, pos)
        if pos + 8 > size:
            raise _Malformed("a step frame shorter than its fixed prefix")
        stored = fmt.unpack_u64(payload, pos)
        if self._last_step is not None and step <= self._last_step:
            raise _Malformed(f"step {step} follows step {self._last_step}; steps must increase")
        self._last_step = step
        self._num_steps += 1
        expected = self._expected_index  # what the INDEX footer must hold: prefix + offset
        expected += payload[: pos + 8]
        while offset > 0x7F:
            expected.append((offset & 0x7F) | 0x80)
            offset >>= 7
        expected.append(offset)
        block = StepBlock(step, count, stored, self, self._last_offset, len(self.names), self._schema,
                          self._names_key, self._may_cap)
        return block, payload, pos + 8, None

    def root_of(self, block: StepBlock, payload: bytes, records_at: int) -> int:
        """Recompute a step's root from its records (``payload`` from `step_frames`)."""
        if block.schema >= 2:
            return fmt.step_root(block.names_key, memoryview(payload)[records_at:])  # no copy
        try:
            return fmt.step_root_v1(self._parse_records(payload, records_at, block.num_records, block.names_count,
                                                        canonical=True, may_cap=block.may_cap))
        except _NewerWriter as err:
            raise StreamError(f"{self.path}: step {block.step} (the step frame at byte {block.offset}): {err}") from None
        except _Malformed as err:
            raise self._corrupt(fmt.FRAME_STEP, block.offset, f"step {block.step}: {err}") from None

    def _check_crc(self, offset: int, payload: bytes, pending: tuple | None) -> None:
        if pending is not None and zlib.crc32(payload, zlib.crc32(pending[0])) != pending[1]:
            raise self._corrupt(fmt.FRAME_STEP, offset, "checksum mismatch")

    def check_root(self, block: StepBlock, payload: bytes, records_at: int, pending: tuple | None = None,
                   root: int | None = None) -> None:
        """Raise `StreamError` unless the frame's deferred checksum (``pending``) holds and
        the stored root of ``block`` is its records' root (``root``: already recomputed by
        the caller from the same bytes)."""
        self._check_crc(block.offset, payload, pending)
        if root is None:
            root = self.root_of(block, payload, records_at)
        if root != block.root:
            raise StreamError(
                f"{self.path}: step {block.step} (the step frame at byte {block.offset} of {self.size}) stores root "
                f"{block.root:016x} but its records hash to {root:016x}: the file is corrupt (its checksum "
                "was recomputed after the damage, or the writer was faulty). " + _CORRUPT_HINT
            )

    def _add_names(self, payload: bytes) -> None:
        first, pos = _fast_varint(payload, 0)
        count, pos = _fast_varint(payload, pos)
        if first != len(self.names):
            raise _Malformed(f"name table out of order (first id {first}, {len(self.names)} names so far)")
        names_start, names, size, decode = pos, self.names, len(payload), fmt.decode_varint
        try:
            for _ in range(count):
                length = payload[pos]
                if length < 0x80:
                    pos += 1
                else:
                    length, pos = decode(payload, pos)
                end = pos + length
                if end > size:
                    raise _Malformed("a name runs past the end of the frame")
                names.append(payload[pos:end].decode())
                pos = end
        except UnicodeDecodeError:
            raise _Malformed(f"name {len(names)} is not valid utf-8") from None
        if pos != len(payload):
            raise _Malformed(f"{len(payload) - pos} stray bytes after the names")
        self._names_hasher.update(payload[names_start:])
        self._names_key = self._names_hasher.digest()

    def _check_index(self, payload: bytes) -> None:
        """The footer must list exactly the steps read so far, with their roots and offsets."""
        count, pos = _fast_varint(payload, 0)
        if count != self._num_steps or payload[pos:] != self._expected_index:
            raise _Malformed(f"the step index ({count} steps) disagrees with the {self._num_steps} steps read")

    def same_frames_as(self, other: "StreamReader") -> bool:
        """Whether this stream and ``other`` both end in a close frame and hold, between their
        header and their final step index, the same bytes (a cheap test, nothing verified:
        see `adopt_verified_twin`)."""
        if not (self._tail_closed and other._tail_closed):
            return False
        if (self.header.get("schema"), self.digest_version) != (other.header.get("schema"), other.digest_version):
            return False  # the same bytes read another way (root encoding, digest): no twins
        mine, theirs = self._final_index_offset(), other._final_index_offset()
        if not (self._first_end <= mine <= self.size and other._first_end <= theirs <= other.size):
            return False
        if mine - self._first_end != theirs - other._first_end:
            return False
        chunk = 1 << 20  # compare in slices: flat memory however long the streams
        for start in range(0, mine - self._first_end, chunk):
            end = min(start + chunk, mine - self._first_end)
            if self._data[self._first_end + start : self._first_end + end] != \
                    other._data[other._first_end + start : other._first_end + end]:
                return False
        return True

    def adopt_verified_twin(self, other: "StreamReader") -> None:
        """Take over the reading of ``other``, which `steps` has read to its clean end with
        every check passed and whose frames after the header are byte for byte this stream's
        (the caller has checked `same_frames_as`): every checksum, root and structural check of those frames holds
        here too (same bytes, same result), so only what depends on this file's own offsets
        is checked: the final step index (offsets shifted by the header length) and the
        close frame.  Raises `StreamError` like a full read would."""
        if not (other.closed_cleanly and other._pos == other.size and self._tail_closed):
            raise StreamError(f"{self.path}: internal error: not a verified twin of {other.path}.")
        shift = self._first_end - other._first_end
        index_at = self._final_index_offset()
        self._pos = index_at
        self._last_kind, self._last_step = fmt.FRAME_STEP, other._last_step
        frame = self._next_frame()
        if frame is None or frame[0] != fmt.FRAME_INDEX:
            raise self._corrupt(None if frame is None else frame[0], index_at, "no step index where the close "
                                "frame points")
        theirs = other._frame_payload(other._final_index_offset())
        if shift == 0:
            same = frame[2] == theirs
        else:
            try:
                entries = [self._index_entries(frame[2]), self._index_entries(theirs)]
            except (IndexError, ValueError, struct_error) as err:
                raise self._corrupt(fmt.FRAME_INDEX, index_at, f"a malformed step index ({err})") from None
            same = len(entries[0]) == len(entries[1]) and all(
                mine[:3] == their[:3] and mine[3] == their[3] + shift for mine, their in zip(*entries))
        if not same:
            raise self._corrupt(fmt.FRAME_INDEX, index_at, f"the step index (frame of {len(frame[2])} bytes) "
                                f"disagrees with the {other._num_steps} steps read")
        close = self._next_frame()
        if close is None or close[0] != fmt.FRAME_CLOSE or close[2][8:] != fmt.CLOSE_MAGIC \
                or fmt.unpack_u64(close[2], 0) != index_at or self._pos != self.size:
            raise self._corrupt(None if close is None else close[0], index_at, "a close frame that does not "
                                "point at the step index just before it")
        self.names = list(other.names)
        self.segments = self.segments[:1] + other.segments[1:]
        self._num_steps = other._num_steps
        self._last_kind, self.closed_cleanly, self.stop_reason = fmt.FRAME_CLOSE, True, None

    def _final_index_offset(self) -> int:
        return fmt.unpack_u64(self._data, self.size - fmt.CLOSE_FRAME_SIZE + 2)

    @staticmethod
    def _index_entries(payload: bytes) -> list[tuple[int, int, int, int]]:
        count, pos = fmt.decode_varint(payload, 0)
        entries = []
        for _ in range(count):
            step, pos = fmt.decode_varint(payload, pos)
            num_records, pos = fmt.decode_varint(payload, pos)
            root = fmt.unpack_u64(payload, pos)
            offset, pos = fmt.decode_varint(payload, pos + 8)
            entries.append((step, num_records, root, offset))
        if pos != len(payload):
            raise fmt.MalformedBytes("stray bytes after the entries")
        return entries

    def step_index(self) -> list[tuple[int, int, int, int]] | None:
        """Every step's (step, record count, root, frame offset) from the footer of a cleanly
        closed stream, reading only the file's tail; None when there is no valid footer.
        Not verified against the steps: comparisons read the steps themselves."""
        if not self._tail_closed:
            return None
        data, size = self._data, self.size
        index_offset = self._final_index_offset()
        try:
            if data[index_offset] != fmt.FRAME_INDEX:
                return None
            length, start = fmt.decode_varint(data, index_offset + 1, size)
            if start + length + 4 > size or zlib.crc32(data[index_offset : start + length]) != fmt.unpack_u32(
                    data, start + length):
                return None
            return self._index_entries(data[start : start + length])
        except (IndexError, ValueError, struct_error):
            return None  # a damaged footer: sequential reading will say where and why

    def _frame_payload(self, offset: int) -> bytes:
        """The payload of the (already verified) frame at ``offset``."""
        length, start = fmt.decode_varint(self._data, offset + 1, self.size)
        return self._data[start : start + length]

    def decode(self, block: StepBlock) -> list[Record]:
        """Decode one step's records (the frame was checksummed when the step was read)."""
        payload = self._frame_payload(block.offset)
        try:
            _, pos = _varint(payload, 0, len(payload))
            _, pos = _varint(payload, pos, len(payload))
            return self._parse_records(payload, pos + 8, block.num_records, block.names_count, may_cap=block.may_cap)
        except _NewerWriter as err:
            raise StreamError(f"{self.path}: step {block.step} (the step frame at byte {block.offset}): {err}") from None
        except _Malformed as err:
            raise StreamError(
                f"{self.path}: step {block.step} (the step frame at byte {block.offset}) is malformed ({err}): "
                "the file is corrupt. " + _CORRUPT_HINT
            ) from None

    def _parse_records(self, payload: bytes, pos: int, count: int, names_count: int, canonical: bool = False,
                       may_cap: bool = True):
        """Decode ``count`` records from ``payload[pos:]``, checking every field; with
        ``canonical`` return the schema-1 root input instead.  A record identity (kind, phase,
        name, occurrence) appears at most once in a step; a record of a kind this samebits does
        not know is refused (it cannot be compared, and skipping it would call the step equal);
        a capped record needs a segment whose header declares a size cap (``may_cap``)."""
        names, size = self.names, len(payload)
        records: list[Record] = []
        out = bytearray()
        seen: set = set()

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
                    f"was written by a newer samebits (its header says samebits {str(self.header.get('samebits')):.40}) "
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

    def close(self) -> None:
        if isinstance(self._data, mmap.mmap):
            self._data.close()
        self._data = b""

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Run:
    """A run directory: one stream per recorded rank."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            exists, is_dir = self.path.exists(), self.path.is_dir()
        except OSError as err:
            raise StreamError(f"{self.path}: cannot access the run directory ({err.strerror}).") from None
        if not exists:
            raise StreamError(f"{self.path}: no such run directory.")
        if not is_dir:
            raise StreamError(f"{self.path}: not a directory; pass the run directory holding rank-*.sbs files.")
        files = {}
        try:
            for entry in self.path.iterdir():
                match = _STREAM_RE.match(entry.name)
                if match:
                    files[int(match.group(1))] = entry
        except PermissionError:
            raise StreamError(f"{self.path}: permission denied listing the run directory; make it readable "
                              f"(e.g. chmod a+rx {self.path}) and retry.") from None
        except OSError as err:
            raise StreamError(f"{self.path}: cannot list the run directory ({err.strerror}).") from None
        if not files:
            raise StreamError(
                f"{self.path}: no fingerprint streams (rank-NNNNN.sbs) in this directory. Was the run "
                "recorded with samebits (Recorder, `samebits run --out DIR`, or SAMEBITS_DIR)?"
            )
        self.files = dict(sorted(files.items()))
        self.ranks = list(self.files)
        # Read every header, keeping no stream open: at thousands of ranks a Run must not hold
        # thousands of mappings; `stream(rank)` opens a rank's stream when it is read.
        self.headers = {}
        for rank, path in self.files.items():
            reader = StreamReader(path)
            self.headers[rank] = reader.header
            reader.close()
        for rank, header in self.headers.items():
            if header["rank"] != rank:
                raise StreamError(
                    f"{self.files[rank]}: the file name says rank {rank} but its header says rank {header['rank']}."
                )
        sizes = {h["world_size"] for h in self.headers.values()}
        if len(sizes) != 1:
            raise StreamError(f"{self.path}: ranks disagree on the world size ({sorted(sizes)}): streams of different runs mixed?")
        self.world_size = sizes.pop()
        versions = {rank: fmt.digest_version_of(h) for rank, h in self.headers.items()}
        if len(set(versions.values())) != 1:
            shown = ", ".join(f"rank {rank}: {version}" for rank, version in versions.items())
            raise StreamError(f"{self.path}: ranks were recorded with different digest versions ({shown}): "
                              "streams of different samebits versions mixed? Re-record the run.")
        self.digest_version = versions[self.ranks[0]]
        _check_one_run(self.path, self.files, self.headers)

    @property
    def header(self) -> dict:
        return self.headers[self.ranks[0]]

    def stream(self, rank: int) -> StreamReader:
        if rank not in self.files:
            raise StreamError(f"{self.path}: no stream for rank {rank} (recorded ranks: {self.ranks}).")
        return StreamReader(self.files[rank])

    def closed_cleanly(self) -> bool:
        """True when every rank of the world wrote its stream and closed it cleanly."""
        if len(self.ranks) != self.world_size:
            return False
        return all(self.stream(rank).step_index() is not None for rank in self.ranks)

    def close(self) -> None:
        """Nothing to release: a Run keeps no stream open (kept for callers that close it)."""


# How a stream's run id was chosen (the header's ``run_id_source``; docs/stream.md, "The
# header").  Ids from these sources are shared by every rank of one run, so ranks that hold
# different ones come from different runs.  A "directory" id is shared by the ranks that
# created their streams in one directory on one host (a file there holds it); a "random" one
# (or a stream from before the field) is this process's own and proves nothing.
SHARED_RUN_ID_SOURCES = ("argument", "SAMEBITS_RUN_ID", "TORCHELASTIC_RUN_ID", "process group")
DIRECTORY_RUN_ID_SOURCE = "directory"


def _check_one_run(path: Path, files: dict, headers: dict) -> None:
    """Refuse a run directory whose rank files come from different runs: ranks whose run ids
    must agree (shared sources; directory ids of one host) but do not."""
    groups: dict[tuple, dict[str, list[int]]] = {}
    for rank, header in headers.items():
        run_id, source = header.get("run_id"), header.get("run_id_source")
        if not isinstance(run_id, str):
            continue
        if source in SHARED_RUN_ID_SOURCES:
            scope = ("shared",)
        elif source == DIRECTORY_RUN_ID_SOURCE:
            environment = header.get("environment")
            host = environment.get("hostname") if isinstance(environment, dict) else None
            if not isinstance(host, str):
                continue
            scope = ("directory", host)
        else:
            continue
        groups.setdefault(scope, {}).setdefault(run_id, []).append(rank)
    for scope, by_id in groups.items():
        if len(by_id) < 2:
            continue
        shown = "; ".join(
            f"run id {run_id!r:.60} in {', '.join(files[r].name for r in ranks[:4])}"
            + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
            for run_id, ranks in sorted(by_id.items(), key=lambda kv: kv[1][0]))
        raise StreamError(
            f"{path}: the rank files come from different runs ({shown}): every rank of one run records "
            "the same run id. Put each run's rank files in a directory of its own (a resumed run keeps "
            "the id of the stream it appends to; ranks of one run that recorded into directories of their "
            "own agree on an id when given one: SAMEBITS_RUN_ID or Recorder(run_id=...)).")


def require_same_digest_version(run_a: Run, run_b: Run) -> None:
    """Refuse to compare runs whose digests are of different versions: they are different
    functions of the same tensors, so every record would look different (never a verdict)."""
    version_a, version_b = run_a.digest_version, run_b.digest_version
    if version_a == version_b:
        return
    current = DIGEST_VERSION
    old = [f"{run.path} (digest version {v})" for run, v in ((run_a, version_a), (run_b, version_b)) if v != current]
    fix = (f"re-record {' and '.join(old)} with this samebits (digest version {current})" if old else
           "compare them with the samebits versions that recorded them")
    raise IncomparableRunsError(
        f"cannot compare {run_a.path} (digest version {version_a}) with {run_b.path} (digest version {version_b}): "
        f"digests of different versions differ for identical tensors. To compare, {fix}.",
        [f"digest version: {version_a} vs {version_b}"],
    )


STOPPED_MARKER = "stopped.json"
"""Left in a run directory when the live check (`Recorder` ``reference``, ``SAMEBITS_REFERENCE``)
stopped the run at a step whose root differs from the reference's: ``{"stopped_at": step,
"rank", "reference", "reason"}`` (written by `samebits.autorecord` and the recipe)."""


def read_stop_marker(directory: str | os.PathLike) -> dict | None:
    """The live check's stop marker in ``directory``, or None; an unreadable one is ``{}``."""
    path = Path(directory) / STOPPED_MARKER
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return {}
    try:
        marker = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return marker if isinstance(marker, dict) else {}


def open_run(path: str | os.PathLike) -> Run:
    """Open a run directory for reading (raises `StreamError` with the reason if unusable)."""
    return Run(path)
