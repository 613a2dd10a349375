"""Reading fingerprint streams: one rank (`StreamReader`) or a whole run directory (`Run`).

Reading is streaming: a step's records are decoded only when asked for, and a comparer
that only needs step roots seeks past the records, so memory stays flat however long
the run.  A stream cut short by a killed writer reads back every complete frame, and
`StreamReader.stop_reason` says where and why reading stopped.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from samebits import fingerprint
from samebits.errors import StreamError
from samebits.stream import _format as fmt

_STREAM_RE = re.compile(r"^rank-(\d{5,})\.sbs$")
_DTYPE_NAMES = {code: str(dtype).removeprefix("torch.") for dtype, code in fingerprint.DTYPE_CODES.items()}
_DTYPE_NAMES[0] = "none"  # an absent tensor (None)


def _dtype_name(code: int) -> str:
    name = _DTYPE_NAMES.get(code)
    if name is None:
        raise ValueError(f"unknown dtype code {code} (written by a newer samebits?)")
    return name


@dataclass(frozen=True)
class Record:
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
        data = torch.frombuffer(bytearray(self.raw), dtype=torch.uint8)
        return data.view(getattr(torch, self.dtype)).item()

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
            return f"{self.value!r} ({self.dtype} 0x{self.raw[::-1].hex()})"
        shape = "x".join(map(str, self.shape)) if self.shape else "scalar"
        if self.absent:
            return "None"
        digest = "capped (no digest)" if self.capped else f"{self.digest:016x}"
        return f"{shape} {self.dtype} {digest}"

    def to_json(self) -> dict:
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


@dataclass
class StepBlock:
    """One step of one rank, not yet decoded."""

    step: int
    num_records: int
    root: int
    reader: "StreamReader"
    offset: int  # where the frame starts in the file
    names_count: int  # how many names were interned before this block

    def records(self) -> list[Record]:
        return self.reader.decode(self)


class StreamReader:
    """Sequential reader of one rank's stream file."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise StreamError(f"{self.path}: no such stream file.")
        self.size = self.path.stat().st_size
        self.names: list[str] = []
        self.segments: list[dict] = []
        self.stop_reason: str | None = None
        self.closed_cleanly = False
        self.end_offset = 0  # the end of the last complete frame
        self._file = open(self.path, "rb")
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
        self._pending_frame = None

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def rank(self) -> int:
        return self.header["rank"]

    def _header(self, frame) -> dict:
        _, offset, payload = frame
        if not payload.startswith(fmt.MAGIC):
            raise StreamError(f"{self.path}: header frame at byte {offset} lacks the samebits magic.")
        try:
            header = json.loads(payload[len(fmt.MAGIC):])
        except ValueError as err:
            raise StreamError(f"{self.path}: header at byte {offset} is not valid JSON ({err}).") from None
        if header.get("schema") != fmt.SCHEMA_VERSION:
            raise StreamError(
                f"{self.path}: stream schema version {header.get('schema')!r}, this samebits reads "
                f"version {fmt.SCHEMA_VERSION}. Read it with the samebits version that wrote it "
                f"({header.get('samebits', 'unknown')})."
            )
        self.segments.append(header)
        return header

    def _read_exact(self, count: int) -> bytes | None:
        data = self._file.read(count)
        return data if len(data) == count else None

    def _next_frame(self, skip_steps: bool = False):
        """Return (kind, offset, payload) or, for skipped step frames, (kind, offset, prefix
        bytes).  None at the end (stop_reason set when the end is not a clean close)."""
        offset = self._file.tell()
        if offset >= self.size:
            if not self.closed_cleanly and self.stop_reason is None:
                self.stop_reason = f"ended without a close frame at byte {offset} (writer killed, or still running)"
            return None
        head = self._file.read(11)
        try:
            kind = head[0]
            length, pos = fmt.decode_varint(head, 1)
        except (IndexError, ValueError):
            return self._torn(offset, "an incomplete frame header")
        if kind not in fmt.FRAME_KINDS:
            raise StreamError(
                f"{self.path}: unknown frame kind {kind} at byte {offset}: the file is corrupt or "
                "was written by a newer samebits."
            )
        end = offset + pos + length + 4
        if end > self.size:
            return self._torn(offset, f"a {fmt.FRAME_KINDS[kind]} frame of {length} bytes")
        self.closed_cleanly = False
        if skip_steps and kind == fmt.FRAME_STEP:
            self._file.seek(offset + pos)
            prefix = self._file.read(min(length, 28))  # step and count varints, u64 root
            self._file.seek(end)
            self.end_offset = end
            return kind, offset, prefix
        self._file.seek(offset)
        data = self._file.read(pos + length + 4)
        payload = data[pos : pos + length]
        stored = fmt.unpack_u32(data, pos + length)
        if zlib.crc32(data[: pos + length]) != stored:
            raise StreamError(
                f"{self.path}: checksum mismatch in the {fmt.FRAME_KINDS[kind]} frame at byte "
                f"{offset} (of {self.size}): the file is corrupt. Records before that byte are intact."
            )
        self.end_offset = end
        return kind, offset, payload

    def _torn(self, offset: int, what: str):
        self.stop_reason = (
            f"truncated at byte {offset} of {self.size}: {what} was cut short (writer killed "
            "mid-write); every complete record before it was read"
        )
        self._file.seek(self.size)
        return None

    def steps(self, verify: bool = False) -> Iterator[StepBlock]:
        """Yield the steps in order.  With ``verify`` every frame's checksum is checked;
        otherwise step frames are skipped over (their records are read by `decode`)."""
        last = None
        while True:
            frame = self._next_frame(skip_steps=not verify)
            if frame is None:
                return
            kind, offset, payload = frame
            if kind == fmt.FRAME_NAMES:
                self._add_names(payload, offset)
            elif kind == fmt.FRAME_HEADER:
                self._header(frame)
            elif kind == fmt.FRAME_CLOSE:
                self.closed_cleanly = True
            elif kind == fmt.FRAME_INDEX:
                pass  # a footer for random access; sequential readers need nothing from it
            else:
                step, pos = fmt.decode_varint(payload, 0)
                count, pos = fmt.decode_varint(payload, pos)
                root = fmt.unpack_u64(payload, pos)
                if last is not None and step <= last:
                    raise StreamError(
                        f"{self.path}: step {step} at byte {offset} follows step {last}; steps must increase."
                    )
                last = step
                yield StepBlock(step, count, root, self, offset, len(self.names))

    def step_index(self) -> list[tuple[int, int, int, int]] | None:
        """Every step's (step, record count, root, frame offset) from the footer of a cleanly
        closed stream, reading only the file's tail; None when there is no valid footer
        (the writer was killed or is still running: read sequentially with `steps`)."""
        if self.size < fmt.CLOSE_FRAME_SIZE:
            return None
        here = self._file.tell()
        saved = (self.end_offset, self.closed_cleanly, self.stop_reason)
        try:
            self._file.seek(self.size - fmt.CLOSE_FRAME_SIZE)
            tail = self._file.read(fmt.CLOSE_FRAME_SIZE)
            if tail[0] != fmt.FRAME_CLOSE or tail[1] != 16 or tail[10:18] != fmt.CLOSE_MAGIC:
                return None
            if zlib.crc32(tail[:18]) != fmt.unpack_u32(tail, 18):
                return None
            index_offset = fmt.unpack_u64(tail, 2)
            if index_offset >= self.size:
                return None
            self._file.seek(index_offset)
            frame = self._next_frame()
            if frame is None or frame[0] != fmt.FRAME_INDEX:
                return None
            payload, pos = frame[2], 0
            count, pos = fmt.decode_varint(payload, pos)
            entries = []
            for _ in range(count):
                step, pos = fmt.decode_varint(payload, pos)
                num_records, pos = fmt.decode_varint(payload, pos)
                root = fmt.unpack_u64(payload, pos)
                offset, pos = fmt.decode_varint(payload, pos + 8)
                entries.append((step, num_records, root, offset))
            return entries
        except StreamError:
            return None  # a damaged footer: sequential reading will say where and why
        finally:
            self._file.seek(here)
            self.end_offset, self.closed_cleanly, self.stop_reason = saved

    def _add_names(self, payload: bytes, offset: int) -> None:
        first, pos = fmt.decode_varint(payload, 0)
        count, pos = fmt.decode_varint(payload, pos)
        if first != len(self.names):
            raise StreamError(f"{self.path}: name table out of order at byte {offset}.")
        for _ in range(count):
            length, pos = fmt.decode_varint(payload, pos)
            self.names.append(payload[pos : pos + length].decode())
            pos += length

    def decode(self, block: StepBlock) -> list[Record]:
        """Read and checksum one step frame and decode its records."""
        here = self._file.tell()
        try:
            self._file.seek(block.offset)
            frame = self._next_frame(skip_steps=False)
        finally:
            self._file.seek(here)
        _, offset, payload = frame
        names = self.names
        pos = 0
        _, pos = fmt.decode_varint(payload, pos)
        _, pos = fmt.decode_varint(payload, pos)
        pos += 8
        records = []
        try:
            for _ in range(block.num_records):
                kind = payload[pos]
                length, pos = fmt.decode_varint(payload, pos + 1)
                end = pos + length
                phase_id, pos = fmt.decode_varint(payload, pos)
                name_id, pos = fmt.decode_varint(payload, pos)
                occurrence, pos = fmt.decode_varint(payload, pos)
                dtype = _dtype_name(payload[pos])
                pos += 1
                if kind == fmt.RECORD_TENSOR:
                    flags, ndim = payload[pos], payload[pos + 1]
                    pos += 2
                    shape = []
                    for _ in range(ndim):
                        size, pos = fmt.decode_varint(payload, pos)
                        shape.append(size)
                    digest = None if flags & (fmt.FLAG_ABSENT | fmt.FLAG_CAPPED) else fmt.unpack_u64(payload, pos)
                    records.append(Record("tensor", names[phase_id], names[name_id], occurrence, dtype,
                                          tuple(shape), flags, digest, None))
                elif kind == fmt.RECORD_METRIC:
                    records.append(Record("metric", names[phase_id], names[name_id], occurrence, dtype,
                                          None, 0, None, bytes(payload[pos:end])))
                pos = end  # unknown record kinds are skipped: forward compatible
        except (IndexError, ValueError, KeyError) as err:
            raise StreamError(
                f"{self.path}: step {block.step} (frame at byte {offset}) is malformed ({err!r})."
            ) from None
        return records

    def close(self) -> None:
        self._file.close()


class Run:
    """A run directory: one stream per recorded rank."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.exists():
            raise StreamError(f"{self.path}: no such run directory.")
        if not self.path.is_dir():
            raise StreamError(f"{self.path}: not a directory; pass the run directory holding rank-*.sbs files.")
        files = {}
        for entry in self.path.iterdir():
            match = _STREAM_RE.match(entry.name)
            if match:
                files[int(match.group(1))] = entry
        if not files:
            raise StreamError(
                f"{self.path}: no fingerprint streams (rank-NNNNN.sbs) in this directory. Was the run "
                "recorded with samebits (Recorder, `samebits run --out DIR`, or SAMEBITS_DIR)?"
            )
        self.files = dict(sorted(files.items()))
        self.ranks = list(self.files)
        self._unused = {rank: StreamReader(path) for rank, path in self.files.items()}
        self.headers = {rank: reader.header for rank, reader in self._unused.items()}
        for rank, header in self.headers.items():
            if header["rank"] != rank:
                raise StreamError(
                    f"{self.files[rank]}: the file name says rank {rank} but its header says rank {header['rank']}."
                )
        sizes = {h["world_size"] for h in self.headers.values()}
        if len(sizes) != 1:
            raise StreamError(f"{self.path}: ranks disagree on the world size ({sorted(sizes)}): streams of different runs mixed?")
        self.world_size = sizes.pop()

    @property
    def header(self) -> dict:
        return self.headers[self.ranks[0]]

    def stream(self, rank: int) -> StreamReader:
        if rank not in self.files:
            raise StreamError(f"{self.path}: no stream for rank {rank} (recorded ranks: {self.ranks}).")
        unused = self._unused.pop(rank, None)  # the reader that read the header, if not yet handed out
        return unused if unused is not None else StreamReader(self.files[rank])

    def closed_cleanly(self) -> bool:
        """True when every rank of the world wrote its stream and closed it cleanly."""
        if len(self.ranks) != self.world_size:
            return False
        return all(self.stream(rank).step_index() is not None for rank in self.ranks)

    def close(self) -> None:
        for reader in self._unused.values():
            reader.close()
        self._unused.clear()


def open_run(path: str | os.PathLike) -> Run:
    """Open a run directory for reading (raises `StreamError` with the reason if unusable)."""
    return Run(path)
