"""The Recorder's files: the stream file (created or continued, locked, written by its owner
process only) and its header, the step-times file beside it, and the run id the ranks of one
run agree on.  A `StreamFile` takes finished frames and writes them in one call per flush.
"""

from __future__ import annotations

import errno
import fcntl
import importlib.metadata
import json
import math
import os
import socket
import time
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from samebits import fingerprint, settings
from samebits.determinism import active_record
from samebits.errors import StreamError
from samebits.stream import _format as fmt
from samebits.stream.environment import environment_fingerprint
from samebits.stream.header import StreamHeader
from samebits.stream.reader import StreamReader

STEP_TIMES_SUFFIX = ".steptimes"
RUN_ID_FILE = ".samebits-run-id"  # in a run directory: the id its ranks agreed on (source "directory")
_RUN_ID_KEY = "samebits/run_id"  # in the process group's store: the id its ranks agreed on


@dataclass
class Continued:
    """What a stream being continued (`StreamFile.append`) already holds."""

    index: list = field(default_factory=list)  # (step, records, root, frame offset) per step
    last_step: int | None = None
    names: list = field(default_factory=list)  # interned names, in id order
    segment: int = 0  # the new segment's number
    run_id: str | None = None
    run_id_source: str | None = None


class StreamFile:
    """One rank's stream file, open for writing: locked while open, written only by the process
    that opened it.  Frames are added to `buffer`; `flush` writes them."""

    def __init__(self, path: Path, file):
        self.path = path
        self._file = file
        self._lock_note: Path | None = None
        self.pid = os.getpid()  # the owning process
        self.buffer = bytearray()
        self.written = 0  # the file offset `buffer` starts at

    @classmethod
    def create(cls, path: Path) -> "StreamFile":
        """A new stream at ``path``; an existing one is an error, never overwritten."""
        try:
            file = open(path, "xb", buffering=0)  # unbuffered: one write per flush
        except FileExistsError:
            raise StreamError(
                f"{path} already exists: samebits never overwrites a stream. Record into a new directory, "
                "delete the old run, or pass append=True to continue it (a resumed run).") from None
        except OSError as err:
            raise StreamError(f"{path}: cannot create the stream ({err.strerror}).") from None
        stream = cls(path, file)
        stream._lock()
        return stream

    @classmethod
    def append(cls, path: Path, rank: int, world_size: int) -> tuple["StreamFile", Continued]:
        """The existing stream at ``path`` (same rank, world size and digest version), positioned
        after its last complete frame, and what it holds."""
        try:
            file = open(path, "r+b", buffering=0)
        except OSError as err:
            raise StreamError(f"{path}: cannot open the stream to append ({err.strerror}).") from None
        stream = cls(path, file)
        try:
            stream._lock()  # before reading: a live writer may still be adding frames
            held, end_offset = _read_existing(path, rank, world_size)
            file.truncate(end_offset)  # drop a torn tail frame, never a complete one
            file.seek(end_offset)
        except BaseException:
            if stream._file is not None:
                stream.release()
            raise
        stream.written = file.tell()
        return stream, held

    def flush(self) -> None:
        """Hands the buffered frames to the OS (one write; they survive a SIGKILL of this process)."""
        buffer = self.buffer
        if buffer:
            if os.getpid() != self.pid:
                raise StreamError(
                    f"{self.path} belongs to the Recorder of process {self.pid}; this is process {os.getpid()}, "
                    "a fork of it: a forked child never writes its parent's stream. Open a Recorder of its own "
                    "in the child (another directory or rank), or record in the parent.")
            done = self._file.write(buffer)  # the file is unbuffered: this is the system call
            while done < len(buffer):  # a short write (rare for a file): the rest
                done += self._file.write(memoryview(buffer)[done:])
            self.written += len(buffer)
            buffer.clear()

    def tell(self) -> int:
        """The file offset the next frame added to `buffer` will have."""
        return self.written + len(self.buffer)

    def release(self) -> None:
        """Close the file (which releases the lock) and remove the lock note."""
        if self._lock_note is not None:
            try:
                self._lock_note.unlink()
            except OSError:
                pass
            self._lock_note = None
        self._file.close()

    def _lock(self) -> None:
        """Hold an exclusive lock on the stream file while this Recorder writes it, and leave
        a note saying who holds it (read by the writer that is refused)."""
        note = self.path.with_name(f".{self.path.name}.lock")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                warnings.warn(f"samebits: cannot lock {self.path} ({err.strerror}); make sure one process "
                              "writes it.", stacklevel=4)  # the Recorder(...) call
                return
            self._file.close()
            self._file = None
            try:
                holder = note.read_text().strip()[:200] or "unknown"
            except OSError:
                holder = "unknown"
            raise StreamError(
                f"{self.path} is being written by another Recorder (holder: {holder}): one writer per "
                "stream. Wait for it to close, give this process another rank or directory, or "
                "append once the other writer has finished."
            ) from None
        try:
            note.write_text(f"pid {os.getpid()} on {socket.gethostname()} since "
                            f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            self._lock_note = note
        except OSError:
            pass  # the lock holds without the note; only the message is less specific


def _read_existing(path: Path, rank: int, world_size: int) -> tuple[Continued, int]:
    """What the stream at ``path`` holds, and where its last complete frame ends."""
    existing = StreamReader(path)
    try:
        theirs = (existing.header.rank, existing.header.world_size)
        if (rank, world_size) != theirs:
            raise StreamError(
                f"{path}: cannot append: the stream was recorded by rank {theirs[0]} of world size "
                f"{theirs[1]}, and this Recorder is rank {rank} of world size {world_size}. A run keeps its "
                "world size and ranks (the reduction order changes with them): record the resumed run into a "
                "new directory and compare it with --from-step.")
        if existing.digest_version != fingerprint.DIGEST_VERSION:
            raise StreamError(
                f"{path}: cannot append: the stream was recorded with digest version "
                f"{existing.digest_version}, this samebits computes digest version "
                f"{fingerprint.DIGEST_VERSION} (steps of both could not be compared). Record the "
                "resumed run into a new directory, or re-record it from the start."
            )
        held = Continued()
        for block in existing.steps():
            held.last_step = block.step
            held.index.append((block.step, block.num_records, block.root, block.offset))
        if existing.stop_reason is not None and existing.stop_reason.startswith("truncated"):
            warnings.warn(f"samebits: appending to {path}, which was {existing.stop_reason}; "
                          "the torn frame is dropped.", stacklevel=4)  # the Recorder(...) call
        held.names, held.segment = list(existing.names), existing.num_segments
        held.run_id, held.run_id_source = existing.header.run_id, existing.header.run_id_source
        return held, existing.end_offset
    finally:
        existing.close()


class StepTimes:
    """``rank-NNNNN.steptimes`` beside the stream, never compared (docs/stream.md, "Step
    times"): ``step<TAB>opened<TAB>written`` per step.  Unwritable costs a warning only."""

    FLUSH_STEPS = 64  # step times reach the OS at least this often, and at close

    def __init__(self, stream_path: Path, header: StreamHeader):
        self.path = stream_path.with_suffix(STEP_TIMES_SUFFIX)
        self._steps: list[tuple[int, float, float]] = []  # (step, opened, written), not yet formatted
        self._origin = time.perf_counter()
        self._lines: list[str] = [json.dumps({"schema": "samebits.step_times/1", "rank": header.rank,
                                              "segment": header.segment, "run_id": header.run_id,
                                              "clock": "perf_counter seconds since the segment started"}) + "\n"]
        try:
            self._file = open(self.path, "a")
        except OSError as err:
            warnings.warn(f"samebits: cannot write step times to {self.path} ({err.strerror}); recording goes on "
                          "without them (samebits tax needs them).", stacklevel=3)  # the Recorder(...) call
            self._file = None

    def add(self, step: int, opened: float) -> None:
        self._steps.append((step, opened, time.perf_counter()))

    def flush_some(self) -> None:
        """`flush` every FLUSH_STEPS steps: a step's own write stays one system call."""
        if len(self._steps) >= self.FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        origin = self._origin
        self._lines += [f"{step}\t{opened - origin:.6f}\t{written - origin:.6f}\n" for step, opened, written in self._steps]
        self._steps.clear()
        if self._file is not None and self._lines:
            self._file.write("".join(self._lines))
            self._file.flush()
        self._lines.clear()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None


# -- the header ----------------------------------------------------------------------------


def stream_header(s, coords, config) -> StreamHeader:
    """A stream's header (docs/stream.md, "The header") for the Recorder settings ``s``, but
    its run id and segment, chosen once the file is open (`StreamFile`, `choose_run_id`)."""
    return StreamHeader(
        schema=fmt.SCHEMA_VERSION,
        digest_version=fingerprint.DIGEST_VERSION,
        rank=s.rank,
        world_size=s.world_size,
        coords=dict(coords or {}),
        config=_jsonable(dict(config or {})),
        window=[s.step_start, s.step_stop],
        phases=sorted(s.phases) if s.phases is not None else None,
        ranks=sorted(s.ranks) if s.ranks is not None else None,
        max_tensor_bytes=s.max_tensor_bytes,
        include=list(s.include) if s.filters_names else None,
        exclude=list(s.exclude) if s.filters_names else None,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        samebits=_samebits_version(),
        environment=environment_fingerprint(),
        determinism=active_record(),
    )


def _jsonable(value):
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float)
                                                                and math.isfinite(value)):
        return value
    return repr(value)  # NaN, infinities and objects: as text


def _samebits_version() -> str:
    try:
        return importlib.metadata.version("samebits")  # not `samebits.__version__`: a layer up
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -- the run id ----------------------------------------------------------------------------


def choose_run_id(run_id, directory: Path) -> tuple[str, str]:
    """(run id, its source), the same on every rank of a run whenever they can agree on one,
    in the order of docs/stream.md, "The header"."""
    if run_id:
        return str(run_id), "argument"
    value = settings.read("SAMEBITS_RUN_ID")
    if value:
        return value, "SAMEBITS_RUN_ID"
    value = os.environ.get("TORCHELASTIC_RUN_ID")
    if value not in (None, "", "none"):
        return value, "TORCHELASTIC_RUN_ID"
    fresh = uuid.uuid4().hex
    agreed = _process_group_run_id(fresh)
    if agreed:
        return agreed, "process group"
    agreed = _directory_run_id(directory, fresh)
    if agreed:
        return agreed, "directory"
    return fresh, "random"


def sibling_run_id(directory: Path, rank: int) -> tuple[str, str] | None:
    """(run id, source) of another rank's stream in ``directory`` (the lowest rank), or None:
    a resumed run that starts a stream beside the ones it continues takes their id."""
    for path in sorted(directory.glob("rank-*" + fmt.STREAM_SUFFIX)):
        if path.name == fmt.stream_filename(rank):
            continue
        try:
            reader = StreamReader(path)
        except StreamError:
            continue
        header = reader.header
        reader.close()
        if header.run_id is not None:
            return header.run_id, header.run_id_source
    return None


def _valid_run_id(value) -> str | None:
    if isinstance(value, bytes):
        try:
            value = value.decode()
        except UnicodeDecodeError:
            return None
    value = value.strip() if isinstance(value, str) else ""
    return value if 0 < len(value) <= 200 and value.isprintable() else None


def _process_group_run_id(fresh: str) -> str | None:
    """The run id of the initialised process group: the first rank to ask stores ``fresh`` in
    the group's store (compare-and-set), every later one reads it.  None without a group."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        store = dist.distributed_c10d._get_default_store()
        return _valid_run_id(store.compare_set(_RUN_ID_KEY, "", fresh))
    except Exception:  # no store, or one without compare-and-set: not agreed this way
        return None


def _directory_run_id(directory: Path, fresh: str) -> str | None:
    """The run id in ``directory``'s `RUN_ID_FILE`, written now (atomically: a hard link of a
    complete file, so the first rank wins and no rank reads half an id) if there is none."""
    target = directory / RUN_ID_FILE
    try:
        return _valid_run_id(target.read_text())
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError):
        return None
    temporary = directory / f"{RUN_ID_FILE}.{os.getpid()}.{fresh[:8]}.tmp"
    try:
        temporary.write_text(fresh + "\n")
        try:
            os.link(temporary, target)
        except FileExistsError:
            pass
        finally:
            temporary.unlink(missing_ok=True)
        return _valid_run_id(target.read_text())
    except (OSError, UnicodeDecodeError):
        return None
