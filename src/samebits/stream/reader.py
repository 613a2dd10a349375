"""Reading fingerprint streams: one rank (`StreamReader`) or a whole run directory (`Run`).
Nothing read is trusted (docs/stream.md, "What a reader checks"); memory stays flat.
"""

from __future__ import annotations
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from struct import error as struct_error
from typing import Iterator

from samebits.errors import IncomparableRunsError, StreamError
from samebits.fingerprint import DIGEST_VERSION
from samebits.stream import _format as fmt
from samebits.stream._frames import _CORRUPT_HINT, FrameFile
from samebits.stream._records import Record, _fast_varint, _Malformed, _NewerWriter, _varint, parse_records
from samebits.stream.header import StreamHeader

_STREAM_RE = re.compile(r"^rank-(\d{5,})\.sbs$")


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


class StreamReader(FrameFile):
    """Sequential, verifying reader of one rank's stream file: its segments' headers, its
    name table, its steps (each root recomputed) and its step-index footer."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)  # maps the file
        self.names: list[str] = []
        self.segments: list[StreamHeader] = []
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
        return self.header.digest_version

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def rank(self) -> int:
        return self.header.rank

    def _header(self, frame) -> StreamHeader:
        _, offset, payload = frame
        where = f"{self.path}: header at byte {offset}"
        header = StreamHeader.from_payload(payload, where)
        if self.segments:
            first = self.segments[0]
            if (header.rank, header.world_size) != (first.rank, first.world_size):
                raise StreamError(f"{where} is invalid (segment of rank {header.rank}/{header.world_size} appended "
                                  f"to a stream of rank {first.rank}/{first.world_size}): the file is corrupt or "
                                  "was not written by samebits.Recorder.")
            if header.digest_version != first.digest_version:
                raise StreamError(f"{self.path}: the segment at byte {offset} has digest version "
                                  f"{header.digest_version}, appended to a stream of digest version "
                                  f"{first.digest_version} (by an older samebits resuming it?): their digests "
                                  "cannot be compared with each other. Re-record the run with one samebits version.")
        self.segments.append(header)
        self._schema, self._may_cap = header.schema, header.caps_tensors
        return header

    def steps(self) -> Iterator[StepBlock]:
        """Yield the steps in order, each frame's checksum and each step's root verified."""
        for frame in self.step_frames():
            self.check_root(*frame)
            yield frame[0]

    def step_frames(self, defer_checksums: bool = False) -> Iterator[tuple[StepBlock, bytes, int, tuple | None]]:
        """Yield (block, frame payload, where its records start, pending) per step, the roots
        not yet recomputed: call ``check_root(*frame)`` on each before using it.  With
        ``defer_checksums``, `check_root` checks the frame's checksum too (``pending``: frame
        head and stored CRC), so a comparer checks two byte-equal frames once."""
        self._rewind()
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

    def _rewind(self) -> None:
        """Back to the first frame after the header, as if nothing after it had been read."""
        self._pos = self._first_end
        self.segments = self.segments[:1]
        self.names = []
        self.stop_reason = None
        self.closed_cleanly = False
        self._reset_state()
        self._schema, self._may_cap = self.header.schema, self.header.caps_tensors
        self._last_kind = fmt.FRAME_HEADER

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
        self._expected_index += payload[: pos + 8]  # what the INDEX footer must hold: prefix + offset
        fmt.encode_varint(offset, self._expected_index)
        block = StepBlock(step, count, stored, self, self._last_offset, len(self.names), self._schema,
                          self._names_key, self._may_cap)
        return block, payload, pos + 8, None

    def root_of(self, block: StepBlock, payload: bytes, records_at: int) -> int:
        """Recompute a step's root from its records (``payload`` from `step_frames`)."""
        if block.schema >= 2:
            return fmt.step_root(block.names_key, memoryview(payload)[records_at:])  # no copy
        try:
            return fmt.step_root_v1(parse_records(payload, records_at, block.num_records, self.names, block.names_count,
                                                  writer=self.header.samebits, canonical=True,
                                                  may_cap=block.may_cap))
        except _NewerWriter as err:
            raise StreamError(f"{self.path}: step {block.step} (the step frame at byte {block.offset}): {err}") from None
        except _Malformed as err:
            raise self._corrupt(fmt.FRAME_STEP, block.offset, f"step {block.step}: {err}") from None

    def _check_crc(self, offset: int, payload: bytes, pending: tuple | None) -> None:
        if pending is not None and zlib.crc32(payload, zlib.crc32(pending[0])) != pending[1]:
            raise self._corrupt(fmt.FRAME_STEP, offset, "checksum mismatch")

    def check_root(self, block: StepBlock, payload: bytes, records_at: int, pending: tuple | None = None,
                   root: int | None = None) -> None:
        """Raise `StreamError` unless the deferred checksum (``pending``) holds and ``block``'s
        stored root is its records' (``root``: already recomputed by the caller)."""
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
        """Whether both streams end in a close frame and hold the same bytes between their header
        and their final step index (a cheap test, nothing verified: `adopt_verified_twin`)."""
        if not (self._tail_closed and other._tail_closed):
            return False
        if (self.header.schema, self.digest_version) != (other.header.schema, other.digest_version):
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
        """Take over the reading of ``other``, read to its clean end with every check passed
        and byte for byte this stream after the header (`same_frames_as`): only what depends
        on this file's offsets is checked (the step index, the close frame)."""
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

    def decode(self, block: StepBlock) -> list[Record]:
        """Decode one step's records (the frame was checksummed when the step was read)."""
        payload = self._frame_payload(block.offset)
        try:
            _, pos = _varint(payload, 0, len(payload))
            _, pos = _varint(payload, pos, len(payload))
            return parse_records(payload, pos + 8, block.num_records, self.names, block.names_count,
                                 writer=self.header.samebits, may_cap=block.may_cap)
        except _NewerWriter as err:
            raise StreamError(f"{self.path}: step {block.step} (the step frame at byte {block.offset}): {err}") from None
        except _Malformed as err:
            raise StreamError(
                f"{self.path}: step {block.step} (the step frame at byte {block.offset}) is malformed ({err}): "
                "the file is corrupt. " + _CORRUPT_HINT
            ) from None


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
        self.headers: dict[int, StreamHeader] = {}
        for rank, path in self.files.items():
            reader = StreamReader(path)
            self.headers[rank] = reader.header
            reader.close()
        for rank, header in self.headers.items():
            if header.rank != rank:
                raise StreamError(
                    f"{self.files[rank]}: the file name says rank {rank} but its header says rank {header.rank}."
                )
        sizes = {h.world_size for h in self.headers.values()}
        if len(sizes) != 1:
            raise StreamError(f"{self.path}: ranks disagree on the world size ({sorted(sizes)}): streams of different runs mixed?")
        self.world_size = sizes.pop()
        versions = {rank: h.digest_version for rank, h in self.headers.items()}
        if len(set(versions.values())) != 1:
            shown = ", ".join(f"rank {rank}: {version}" for rank, version in versions.items())
            raise StreamError(f"{self.path}: ranks were recorded with different digest versions ({shown}): "
                              "streams of different samebits versions mixed? Re-record the run.")
        self.digest_version = versions[self.ranks[0]]
        _check_one_run(self.path, self.files, self.headers)

    @property
    def header(self) -> StreamHeader:
        return self.headers[self.ranks[0]]

    def stream(self, rank: int) -> StreamReader:
        if rank not in self.files:
            raise StreamError(f"{self.path}: no stream for rank {rank} (recorded ranks: {self.ranks}).")
        return StreamReader(self.files[rank])

    def steps(self, rank: int) -> Iterator[StepBlock]:
        """Rank ``rank``'s steps in order (`StreamReader.steps`), its stream closed when the
        walk ends or is left."""
        reader = self.stream(rank)
        try:
            yield from reader.steps()
        finally:
            reader.close()

    def closed_cleanly(self) -> bool:
        """True when every rank of the world wrote its stream and closed it cleanly."""
        if len(self.ranks) != self.world_size:
            return False
        return all(self.stream(rank).step_index() is not None for rank in self.ranks)

    def close(self) -> None:
        """Nothing to release: a Run keeps no stream open (`steps` closes what it opens)."""


# Run id sources (docs/stream.md, "The header") shared by every rank of a run, so different ids
# mean different runs; a "directory" id only by the ranks of one host, a "random" one by none.
SHARED_RUN_ID_SOURCES = ("argument", "SAMEBITS_RUN_ID", "TORCHELASTIC_RUN_ID", "process group")
DIRECTORY_RUN_ID_SOURCE = "directory"


def _check_one_run(path: Path, files: dict, headers: dict) -> None:
    """Refuse a run directory whose rank files come from different runs: ranks whose run ids
    must agree (shared sources; directory ids of one host) but do not."""
    groups: dict[tuple, dict[str, list[int]]] = {}
    for rank, header in headers.items():
        run_id, source = header.run_id, header.run_id_source
        if not isinstance(run_id, str):
            continue
        if source in SHARED_RUN_ID_SOURCES:
            scope = ("shared",)
        elif source == DIRECTORY_RUN_ID_SOURCE:
            host = header.environment.get("hostname")
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
        marker = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):  # unreadable, not utf-8, not JSON
        return {}
    return marker if isinstance(marker, dict) else {}


def open_run(path: str | os.PathLike) -> Run:
    """Open a run directory for reading (raises `StreamError` with the reason if unusable)."""
    return Run(path)
