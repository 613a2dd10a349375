"""Following a stream while its writer is still writing it: the steps as they land, for a live
view (`samebits.runners.progress`).  Nothing is verified: `StreamReader` judges the stream.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from samebits.errors import StreamError
from samebits.stream import _format as fmt
from samebits.stream.header import StreamHeader

_MAX_WALKED_RECORDS = 1 << 20  # a step with more records is shown without its last record's name
# The largest frame followed (its bytes are read once it is complete): far above what a step of
# millions of records takes; a larger length is a damaged field, and the verifying reader judges
# the stream after the run.
MAX_FRAME_BYTES = 256 << 20
_HEAD_BYTES = 11  # a frame's kind byte and its length varint (at most 10 bytes)


@dataclass(frozen=True)
class StepSeen:
    """One step frame that landed: its step number, how many records it holds, and the phase
    and name of its last record (None when the step holds none)."""

    step: int
    records: int
    last: tuple[str, str] | None


class StreamTail:
    """Follow one rank's stream file as it grows: a `poll` costs one ``stat`` when it has not, else
    a read of the completed frames, one at a time.  A frame that does not decode ends it (`broken`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.rank: int | None = None  # from the header frame, once it landed
        self.names: list[str] = []
        self.broken: str | None = None  # why following stopped (a frame that does not decode)
        self._offset = 0  # the file offset of the first frame not yet parsed
        self._waiting_for = 0  # the file size the frame at _offset needs to be complete (0: not known)

    def poll(self) -> list[StepSeen]:
        """The steps whose frames completed since the last poll, in order ([] when none did)."""
        if self.broken is not None:
            return []
        try:
            size = os.stat(self.path).st_size
        except OSError:
            return []  # not there yet, or gone: nothing new
        if size <= self._offset or size < self._waiting_for:
            return []  # nothing new, or the frame in writing is not complete yet: not read again
        seen: list[StepSeen] = []
        try:
            with open(self.path, "rb") as file:
                while self.broken is None and self._offset < size:
                    frame = self._frame(file, self._offset, size)
                    if frame is None:
                        break  # the writer is still writing this frame
                    kind, payload, end = frame
                    try:
                        self._take(kind, payload, seen)
                    except (StreamError, ValueError, IndexError, UnicodeDecodeError, KeyError, TypeError) as err:
                        self.broken = f"a {fmt.FRAME_KINDS.get(kind, kind)} frame that does not decode ({err})"
                        break
                    self._offset, self._waiting_for = end, 0
        except OSError:
            pass  # gone while read: what was parsed stands
        return seen

    def _frame(self, file, pos: int, size: int):
        """(kind, payload, end) of the complete frame at file offset ``pos``, or None when it is
        incomplete (``_waiting_for``: the size it needs, once its length is known)."""
        file.seek(pos)
        head = file.read(_HEAD_BYTES)
        if not head:
            return None
        kind = head[0]
        if kind not in fmt.FRAME_KINDS:
            self.broken = f"an unknown frame kind {kind} at byte {pos}"
            return None
        try:
            length, start = fmt.decode_varint(head, 1, len(head))
        except IndexError:
            return None  # the length field itself is not written yet
        except ValueError as err:
            self.broken = f"an invalid frame length at byte {pos} ({err})"
            return None
        if length > MAX_FRAME_BYTES:
            self.broken = (f"a {fmt.FRAME_KINDS[kind]} frame of {length} bytes at byte {pos}, over the follower's "
                           f"limit of {MAX_FRAME_BYTES} bytes (a damaged length field?)")
            return None
        end = pos + start + length + 4
        if end > size:
            self._waiting_for = end
            return None
        file.seek(pos)
        data = file.read(start + length + 4)
        if len(data) < start + length + 4:
            return None  # shrank under us: wait
        payload = data[start:start + length]
        if zlib.crc32(payload, zlib.crc32(data[:start])) != fmt.unpack_u32(data, start + length):
            self.broken = f"a frame whose checksum does not match at byte {pos}"
            return None
        return kind, payload, end

    def _take(self, kind: int, payload: bytes, seen: list[StepSeen]) -> None:
        if kind == fmt.FRAME_HEADER:
            self.rank = StreamHeader.from_payload(payload, f"{self.path}: a header").rank
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
        for _ in range(count):  # past each record's kind byte and length varint
            length, body = fmt.decode_varint(payload, pos + 1)
            pos = body + length
        phase, at = fmt.decode_varint(payload, body)
        name, _ = fmt.decode_varint(payload, at)
        return self.names[phase], self.names[name]


__all__ = ["StreamTail", "StepSeen", "MAX_FRAME_BYTES"]
