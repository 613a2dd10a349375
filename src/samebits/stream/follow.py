"""Following a stream while its writer is still writing it: the steps as they land.

`StreamTail.poll` looks at the file's size and reads only the bytes added since the last
poll: the frames that completed in them (a frame the writer has not finished yet waits for
the next poll), with no check of step roots or records.  It is how a watcher shows a run's
progress live (`samebits.runs.progress`); it proves nothing about the stream, which the
verifying reader (`StreamReader`) judges after the run.  A frame that does not decode (a
damaged file, a newer writer) ends the following quietly: `StreamTail.broken` says why.
"""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from samebits.stream import _format as fmt

_MAX_WALKED_RECORDS = 1 << 20  # a step with more records is shown without its last record's name


@dataclass(frozen=True)
class StepSeen:
    """One step frame that landed: its step number, how many records it holds, and the phase
    and name of its last record (None when the step holds none)."""

    step: int
    records: int
    last: tuple[str, str] | None


class StreamTail:
    """Follow one rank's stream file (``rank-NNNNN.sbs``) as it grows.

    Each `poll` costs one ``stat`` when the file has not grown, and otherwise one read of the
    new bytes; the names interned so far are kept, so that a step's last record can be named."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.rank: int | None = None  # from the header frame, once it landed
        self.names: list[str] = []
        self.broken: str | None = None  # why following stopped (a frame that does not decode)
        self._offset = 0  # the file offset of the first byte not yet read
        self._pending = b""  # bytes read whose frame is not complete yet

    def poll(self) -> list[StepSeen]:
        """The steps whose frames completed since the last poll, in order ([] when none did)."""
        if self.broken is not None:
            return []
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return []  # not there yet, or gone: nothing new
        if size <= self._offset:
            return []
        try:
            with open(self.path, "rb") as file:
                file.seek(self._offset)
                added = file.read(size - self._offset)
        except OSError:
            return []
        self._offset += len(added)
        data = self._pending + added if self._pending else added
        seen: list[StepSeen] = []
        pos = 0
        while pos < len(data):
            frame = self._frame(data, pos)
            if frame is None:
                break  # the writer is still writing this frame
            kind, payload, end = frame
            try:
                self._take(kind, payload, seen)
            except (ValueError, IndexError, UnicodeDecodeError, KeyError, TypeError) as err:
                self.broken = f"a {fmt.FRAME_KINDS.get(kind, kind)} frame that does not decode ({err})"
                break
            pos = end
        self._pending = b"" if self.broken is not None else bytes(data[pos:])
        return seen

    def _frame(self, data: bytes, pos: int):
        """(kind, payload, end) of the complete frame at ``pos``, or None when it is incomplete."""
        kind = data[pos]
        if kind not in fmt.FRAME_KINDS:
            self.broken = f"an unknown frame kind {kind}"
            return None
        try:
            length, start = fmt.decode_varint(data, pos + 1, min(len(data), pos + 11))
        except IndexError:
            return None
        except ValueError as err:
            self.broken = f"an invalid frame length ({err})"
            return None
        end = start + length + 4
        if end > len(data):
            return None
        payload = data[start:start + length]
        if zlib.crc32(payload, zlib.crc32(data[pos:start])) != fmt.unpack_u32(data, start + length):
            self.broken = "a frame whose checksum does not match"
            return None
        return kind, payload, end

    def _take(self, kind: int, payload: bytes, seen: list[StepSeen]) -> None:
        if kind == fmt.FRAME_HEADER:
            header = json.loads(payload[len(fmt.MAGIC):])
            self.rank = int(header.get("rank", 0))
            self.names = []  # a new segment interns its names afresh
        elif kind == fmt.FRAME_NAMES:
            first, pos = fmt.decode_varint(payload, 0)
            count, pos = fmt.decode_varint(payload, pos)
            if first != len(self.names):
                raise ValueError(f"name table out of order (first id {first}, {len(self.names)} names so far)")
            for _ in range(count):
                length, pos = fmt.decode_varint(payload, pos)
                self.names.append(bytes(payload[pos:pos + length]).decode())
                pos += length
        elif kind == fmt.FRAME_STEP:
            step, pos = fmt.decode_varint(payload, 0)
            count, pos = fmt.decode_varint(payload, pos)
            seen.append(StepSeen(step, count, self._last_record(payload, pos + 8, count)))

    def _last_record(self, payload: bytes, pos: int, count: int) -> tuple[str, str] | None:
        """(phase, name) of the step's last record: the records are walked by their lengths."""
        if count == 0 or count > _MAX_WALKED_RECORDS:
            return None
        start = pos
        for _ in range(count):
            start = pos
            length, pos = fmt.decode_varint(payload, pos + 1)
            pos += length
        phase, at = fmt.decode_varint(payload, _body_start(payload, start))
        name, _ = fmt.decode_varint(payload, at)
        return self.names[phase], self.names[name]


def _body_start(payload: bytes, record_at: int) -> int:
    """Where a record's body starts: after its kind byte and its length varint."""
    _, pos = fmt.decode_varint(payload, record_at + 1)
    return pos


__all__ = ["StreamTail", "StepSeen"]
