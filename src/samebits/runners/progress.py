"""Live progress of long work: what the run in flight is doing, read from its streams.

A `StepWatcher` thread follows a run's fingerprint streams (`samebits.stream.follow.StreamTail`:
one ``stat`` per file per poll, only new bytes read) and reports each new step, and once per
stall a run that writes no step for ``stall_factor`` times its median step time::

    [  12.3s] B: step 17 done (18/80)  2.4 steps/s  run 7.5s  last: optimizer/fc.weight.exp_avg
    [ 130.2s] B: no step for 95 s (median step 2.1 s): still running, see samebits-out/.../b.log

`Progress` is the CLI's ``progress`` callback: one status line rewritten in place on a terminal,
plain lines at most one per ``plain_interval_s`` elsewhere; ``quiet`` leaves only stall reports.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
import unicodedata
from pathlib import Path
from typing import Callable, Iterator

from samebits.stream.follow import StepSeen, StreamTail

POLL_S = 0.25  # how often a watcher looks at the streams
PLAIN_INTERVAL_S = 1.0  # plain lines: at most one per run this often (each step when slower)
STATUS_INTERVAL_S = 1.0  # a terminal's status line is redrawn at least this often (its elapsed time moves)
STALL_FACTOR = 10.0  # a stall: no step for this many median step times ...
MIN_STALL_S = 30.0  # ... and at least this long
_CLEAR = "\r\x1b[K"  # carriage return, erase to the end of the line


def _identity(text: str) -> str:
    return text


_UNSAFE = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})  # controls, format (bidi) characters, line separators


def one_line(name: str) -> str:
    """A recorded name as one line of safe text: a newline, an escape sequence or a bidi
    override in a record name is shown as ``\\n``, ``\\x1b``, ``\\u202e``, never sent (a
    name must not print a second, fake progress line)."""
    if name.isprintable():
        return name
    return "".join(char if unicodedata.category(char) not in _UNSAFE and char.isprintable() or char == " "
                   else (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
                         if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
                   for char in name)


class Progress:
    """Progress messages of one command, each after the time since it started, ``[  12.3s]``.
    ``file`` default: ``sys.stderr`` when written; ``tty`` default: ask the file; ``clean``: what
    every message passes through (the CLI's terminal-safe `escape`)."""

    def __init__(self, file=None, *, quiet: bool = False, tty: bool | None = None,
                 clean: Callable[[str], str] = _identity, stall_factor: float = STALL_FACTOR,
                 min_stall_s: float = MIN_STALL_S, poll_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic):
        self._file = file
        self.quiet = quiet
        self._tty = tty
        self.clean = clean
        self.stall_factor = stall_factor
        self.min_stall_s = min_stall_s
        self.poll_s = poll_s
        self.clock = clock
        self.began = clock()
        self._lock = threading.Lock()
        self._status = ""  # the status line on screen (a terminal only), "" when none
        self._prefix = ""
        self._of: Progress | None = None  # the progress an `indented` view writes through

    @property
    def file(self):
        return self._file if self._file is not None else sys.stderr

    @property
    def tty(self) -> bool:
        if self._tty is None:
            isatty = getattr(self.file, "isatty", None)
            return bool(isatty and isatty())
        return self._tty

    def _stamp(self) -> str:
        return f"[{self.clock() - self.began:6.1f}s] "

    def _line(self, message: str) -> str:
        stamp = self._stamp()
        message = self._prefix + str(message).strip() if self._prefix else str(message)
        text = self.clean(message).replace("\n", "\n" + " " * len(stamp))
        return stamp + text

    def __call__(self, message: str) -> None:
        """A progress message (a stage of the work): one line, or lines indented under the first."""
        if not self.quiet:
            self._write(self._line(message))

    def warn(self, message: str) -> None:
        """A message that ``quiet`` does not silence (a stalled run)."""
        self._write(self._line(message))

    def status(self, message: str) -> None:
        """The live line of the run in flight: rewritten in place on a terminal, else a line."""
        if self.quiet:
            return
        root = self._root()
        if not root.tty:
            self._write(self._line(message))
            return
        line = self._line(message).split("\n")[0][:root._columns() - 1]  # a wrapped line could not be rewritten
        with root._lock:
            root._status = line
            root.file.write(_CLEAR + line)
            root.file.flush()

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.file.fileno()).columns or 100
        except (AttributeError, OSError, ValueError):
            return 100

    def end_status(self) -> None:
        """Erase the status line (the run it showed has ended)."""
        root = self._root()
        with root._lock:
            if root._status:
                root._status = ""
                root.file.write(_CLEAR)
                root.file.flush()

    def _write(self, line: str) -> None:
        root = self._root()
        with root._lock:
            file = root.file
            if root._status:  # a line goes above the status line, which is drawn again under it
                file.write(_CLEAR + line + "\n" + root._status)
            else:
                file.write(line + "\n")
            file.flush()

    def indented(self, prefix: str) -> "Progress":
        """The same progress, each message stripped and after ``prefix`` (work nested in other
        work: a matrix cell's verify)."""
        view = object.__new__(Progress)
        view.__dict__.update(self.__dict__)  # the same settings and clock; the root's file and status line
        view._prefix = self._prefix + prefix
        view._of = self._root()
        return view

    def _root(self) -> "Progress":
        return self._of if self._of is not None else self

    @contextlib.contextmanager
    def watch(self, streams: str | os.PathLike, label: str, *, steps: int | None = None,
              log: str | os.PathLike | None = None, plain: bool = False) -> Iterator["StepWatcher"]:
        """Follow the streams in ``streams`` while the block runs (a `StepWatcher` thread).
        ``plain``: plain lines even on a terminal (a run whose own output shares it)."""
        live = self._root().tty and not plain
        watcher = StepWatcher(streams, label, show=None if self.quiet else (self.status if live else self),
                              warn=self.warn, steps=steps, log=log,
                              interval_s=STATUS_INTERVAL_S if live else PLAIN_INTERVAL_S,
                              every_change=live, stall_factor=self.stall_factor, min_stall_s=self.min_stall_s,
                              clock=self.clock)
        with watcher.running(self.poll_s):
            try:
                yield watcher
            finally:
                watcher.stop()
                if live:
                    self.end_status()


def watching(progress: Callable[[str], None] | None, streams: str | os.PathLike | None, label: str, *,
             steps: int | None = None, log: str | os.PathLike | None = None, plain: bool = False):
    """The context in which a launched run is followed: ``progress.watch`` for a `Progress`, plain
    lines for any other callable, nothing without a callback or a folder."""
    if progress is None or streams is None:
        return contextlib.nullcontext()
    if isinstance(progress, Progress):
        return progress.watch(streams, label, steps=steps, log=log, plain=plain)
    watcher = StepWatcher(streams, label, show=progress, warn=progress, steps=steps, log=log)
    return watcher.running(POLL_S)


def indented(progress: Callable[[str], None] | None, prefix: str) -> Callable[[str], None] | None:
    """``progress`` with every message after ``prefix``: a `Progress` stays one (its runs are
    still followed, on the same status line)."""
    if progress is None:
        return None
    if isinstance(progress, Progress):
        return progress.indented(prefix)
    return lambda message: progress(prefix + str(message).strip())


class StepWatcher:
    """Follow one run's streams (``rank-*.sbs`` in ``streams``) and report its steps.

    `poll` does one look: new steps become a line for ``show`` (``every_change``: each look that
    saw one, and at least every ``interval_s``; else at most one per ``interval_s``); a stall is
    reported once to ``warn``, and its end too.  `running` polls in a thread while a block runs."""

    def __init__(self, streams: str | os.PathLike, label: str, *, show: Callable[[str], None] | None,
                 warn: Callable[[str], None], steps: int | None = None, log: str | os.PathLike | None = None,
                 interval_s: float = PLAIN_INTERVAL_S, every_change: bool = False,
                 stall_factor: float = STALL_FACTOR, min_stall_s: float = MIN_STALL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.streams = Path(streams)
        self.label = label
        self.show = show
        self.warn = warn
        self.steps = steps
        self.log = log
        self.interval_s = interval_s
        self.every_change = every_change
        self.stall_factor = stall_factor
        self.min_stall_s = min_stall_s
        self.clock = clock
        self.started = clock()
        self.tails: dict[str, StreamTail] = {}
        self.last_step: dict[int, int] = {}  # rank -> the last step it wrote
        self.done: dict[int, int] = {}  # rank -> steps written
        self.last_record: tuple[str, str] | None = None
        self.arrivals: list[tuple[float, int]] = []  # (when, steps done by then): one per look that saw steps
        self.intervals: list[float] = []  # seconds per step, one per look that saw steps
        self.shown_at: float | None = None  # when the last line was shown
        self.unshown = False  # steps seen since the last line
        self.stalled_since: float | None = None  # the last step's time, when a stall was reported
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- one look -----------------------------------------------------------------------------

    def poll(self) -> None:
        now = self._look()
        if self.unshown and self.show is not None and (
                self.every_change or self.shown_at is None or now - self.shown_at >= self.interval_s):
            self._show(now)
        elif self.every_change and self.show is not None and self.arrivals and \
                self.shown_at is not None and now - self.shown_at >= self.interval_s:
            self._show(now)  # the status line's elapsed time moves on
        self._check_stall(now)

    def _look(self) -> float:
        """Take the steps written since the last look; returns when it looked."""
        now = self.clock()
        seen = self._read_new_steps()
        if seen:
            self._take(now, seen)
        return now

    def _read_new_steps(self) -> list[tuple[int, StepSeen]]:
        try:
            names = sorted(name for name in os.listdir(self.streams)
                           if name.startswith("rank-") and name.endswith(".sbs"))
        except OSError:
            return []  # the run has not made its folder yet
        seen = []
        for name in names:
            tail = self.tails.get(name)
            if tail is None:
                tail = self.tails[name] = StreamTail(self.streams / name)
            for step in tail.poll():
                seen.append((tail.rank if tail.rank is not None else -1, step))
        return seen

    def _take(self, now: float, seen: list[tuple[int, StepSeen]]) -> None:
        before = self.num_done
        for rank, step in seen:
            self.last_step[rank] = step.step
            self.done[rank] = self.done.get(rank, 0) + 1
            if step.last is not None:
                self.last_record = step.last
        after = self.num_done
        if after > before:
            if self.arrivals:
                self.intervals.append((now - self.arrivals[-1][0]) / (after - before))
            self.arrivals.append((now, after))
            self.unshown = True
            if self.stalled_since is not None:
                self.warn(f"{self.label}: step {max(self.last_step.values())} done after {now - self.stalled_since:.0f} s "
                          "without a step")
                self.stalled_since = None

    @property
    def num_done(self) -> int:
        """Steps the furthest rank has written."""
        return max(self.done.values(), default=0)

    def median_step_s(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def steps_per_s(self) -> float | None:
        """The recent rate: over the last (up to) ten looks that saw steps."""
        recent = self.arrivals[-11:]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return None
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])

    def line(self, now: float) -> str:
        """``B: step 17 done (18/80)  2.4 steps/s  run 7.5s  last: optimizer/fc.weight``."""
        lead = max(self.last_step.values())
        text = f"{self.label}: step {lead} done ({self.num_done}" + (f"/{self.steps})" if self.steps else ")")
        behind = sorted((rank, step) for rank, step in self.last_step.items() if step < lead)
        if behind:
            text += " " + ", ".join(f"rank {rank} at step {step}" for rank, step in behind[:3])
            text += f" and {len(behind) - 3} more behind" if len(behind) > 3 else ""
        rate = self.steps_per_s()
        if rate is not None:
            text += f"  {rate:.1f} steps/s" if rate >= 1 else f"  {1 / rate:.1f} s/step"
        text += f"  run {now - self.started:.1f}s"
        if self.last_record is not None:
            text += f"  last: {one_line(self.last_record[0])}/{one_line(self.last_record[1])}"
        return text

    def _show(self, now: float) -> None:
        self.show(self.line(now))
        self.shown_at = now
        self.unshown = False

    def _check_stall(self, now: float) -> None:
        median = self.median_step_s()
        if median is None or self.stalled_since is not None:
            return
        last = self.arrivals[-1][0]
        limit = max(self.stall_factor * median, self.min_stall_s)
        if now - last >= limit:
            self.stalled_since = last
            where = f"see {self.log}" if self.log is not None else "see its output"
            self.warn(f"{self.label}: no step for {now - last:.0f} s (median step {median:.1f} s): still running, "
                      f"{where}")

    # -- in a thread --------------------------------------------------------------------------

    @contextlib.contextmanager
    def running(self, poll_s: float = POLL_S) -> Iterator["StepWatcher"]:
        """Poll every ``poll_s`` seconds in a daemon thread while the block runs; one last look
        (and the last step's line) after it."""
        self._thread = threading.Thread(target=self._loop, args=(poll_s,), name=f"samebits-progress-{self.label}",
                                        daemon=True)
        self._thread.start()
        try:
            yield self
        finally:
            self.stop()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.error is None:
            self._guarded(self._final_look)

    def _final_look(self) -> None:
        now = self._look()
        if self.unshown and self.show is not None:
            self._show(now)

    def _loop(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s) and self.error is None:
            self._guarded(self.poll)

    def _guarded(self, look: Callable[[], None]) -> None:
        """A look that fails (a bug, a closed terminal) ends the watching, never the run."""
        try:
            look()
        except Exception as err:  # noqa: BLE001 - progress is never worth a failed run
            self.error = f"{type(err).__name__}: {err}"
            with contextlib.suppress(Exception):
                self.warn(f"{self.label}: live progress stopped ({self.error})")


__all__ = ["Progress", "StepWatcher", "watching", "indented", "POLL_S", "PLAIN_INTERVAL_S", "STALL_FACTOR",
           "MIN_STALL_S"]
