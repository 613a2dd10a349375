"""A stream file read frame by frame: `FrameFile` maps the file, walks its frames checking
each checksum, and tells a killed writer's torn last frame (`stop_reason`) from damage (a
`StreamError` naming file, byte offset and frame).  What frames mean is `reader.StreamReader`'s.
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from pathlib import Path
from struct import error as struct_error

import numpy as np

from samebits.errors import StreamError
from samebits.stream import _format as fmt
from samebits.stream.file_kind import file_kind

_CORRUPT_HINT = ("Every frame before that byte is intact: compare up to the step before it "
                 "(--to-step), or re-record the run.")


class FrameFile:
    """One stream file, mapped read-only and read frame by frame from `_pos`."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.stop_reason: str | None = None
        self.closed_cleanly = False
        self.end_offset = 0  # the end of the last complete frame
        self._last_step: int | None = None  # the last step read (named in errors)
        self._data = b""
        try:
            # O_NONBLOCK: a FIFO in place of a stream must not block the open; the opened file
            # itself is then checked (no window between a check and the open)
            descriptor = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with open(descriptor, "rb") as file:
                status = os.fstat(file.fileno())
                if not stat.S_ISREG(status.st_mode):
                    raise StreamError(f"{self.path}: not a regular file ({file_kind(status.st_mode)}); a "
                                      "fingerprint stream is a regular rank-NNNNN.sbs file written by samebits.")
                if status.st_size:
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
        checksum starts (a torn write leaves none), or None.  Candidates are checksummed cheapest
        first within a budget linear in the bytes scanned.  Memoised per offset."""
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

    def close(self) -> None:
        if isinstance(self._data, mmap.mmap):
            self._data.close()
        self._data = b""

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

