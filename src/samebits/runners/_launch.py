"""Running one training command for verify and bisect: logged, bounded, and judged.

A run's output goes to a log file (its first line is the command); a run past its time limit is
killed with every process it started; a failed run says what went wrong first, then its log's
end.  A run is judged by proof, never by how complete its streams look: the recipe by its exit
status (or the live check's stop marker); a zero-code run also by every recording process's
outcome file (`samebits.autorecord`): a non-zero exit keeps its records only when every
process's own code ended cleanly, with every stream closed.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from samebits.autorecord import read_outcomes
from samebits.defaults import DEFAULT_TIMEOUT_S
from samebits.errors import SamebitsError, StreamError
from samebits.runners.progress import watching
from samebits.stream import open_run

_TAIL_LINES = 15
_VIOLATION = re.compile(r"^\s*- \[[a-z0-9][\w.-]*\] ")  # one line of a DeterminismError
_ERROR_LINE = re.compile(r"^samebits[\w.]*: (error|zero-code recording disabled)")  # samebits' own complaint
_WORKER_EXIT = re.compile(r"exitcode\s*:\s*(-?\d+)")  # torchrun's summary of a failed worker


class RunFailed(SamebitsError):
    """A launched run did not finish: ``reason`` is the first line of what went wrong,
    ``label`` the run's name (e.g. "A", "C (resume)")."""

    def __init__(self, message: str, reason: str, label: str = ""):
        super().__init__(message)
        self.reason = reason
        self.label = label


def run_logged(argv: list[str], log: Path, *, env: dict | None = None, header: str = "",
               timeout: float | None = DEFAULT_TIMEOUT_S, label: str = "",
               progress: Callable[[str], None] | None = None, streams: Path | None = None,
               steps: int | None = None) -> tuple[int, float]:
    """Run ``argv`` with its output in ``log``; return (exit code, seconds).  With ``progress``
    and ``streams`` its steps are reported live (`samebits.runners.progress`).

    The run does not outlive the call: past ``timeout``, or when samebits is interrupted
    (`Interrupted`), every process it started is ended (`end_process_tree`); on Linux it also
    gets SIGTERM if samebits itself dies (SIGKILL included)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # the command line as text: a path that is not UTF-8 (``--out $'o\xff'``) is written as
    # `\xff`, never raised as UnicodeEncodeError (the run itself gets the bytes as given)
    line = "$ " + (header + " " if header else "") + shlex.join(argv) + "\n"
    line = line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    with open(log, "w", encoding="utf-8", errors="backslashreplace") as handle:
        handle.write(line)
        handle.flush()
        with _signals_interrupt():
            try:
                process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True, preexec_fn=_die_with_parent())
            except FileNotFoundError:
                raise SamebitsError(f"cannot run {argv[0]!r}: no such program. Check the command.") from None
            try:
                with watching(progress, streams, label, steps=steps, log=log):
                    code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                end_process_tree(process)  # the run and every process it started
                raise SamebitsError(f"run {label} ({shlex.join(argv)}) did not finish within {timeout:.0f} s "
                                    f"(a hang, e.g. ranks waiting on each other); its log: {log}. Raise "
                                    "--run-timeout if it is merely slow.") from None
            except BaseException:  # Ctrl-C, SIGTERM, SIGHUP (`Interrupted`), or anything else: no orphans
                end_process_tree(process)
                raise
    return code, time.perf_counter() - start


def run_attached(argv: list[str], *, env: dict | None = None, progress: Callable[[str], None] | None = None,
                 streams: Path | None = None) -> int:
    """Run ``argv`` on samebits' own terminal (Ctrl-C reaching it as usual); return its exit code.
    Progress comes as plain lines (the run shares the terminal); like `run_logged`, it does not
    outlive samebits."""
    with _signals_interrupt():
        try:
            process = subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent())
        except FileNotFoundError:
            raise SamebitsError(f"cannot run {argv[0]!r}: no such program. Check the command after `--`.") from None
        try:
            with watching(progress, streams, "run", plain=True):
                return process.wait()
        except BaseException:
            end_process_tree(process)
            raise


# ---------------------------------------------------------------------------------------------
# ending a run's whole process tree

END_GRACE_S = 5.0  # after SIGTERM, how long a run's processes may take to end before SIGKILL


class Interrupted(KeyboardInterrupt):
    """samebits was told to stop (SIGINT, SIGTERM or SIGHUP, ``signum``) while it waited for a
    run; the run's processes have been ended.  A `KeyboardInterrupt`, so that whoever handles
    Ctrl-C handles it; the CLI exits with 128 + ``signum``, as a shell reports a signal."""

    def __init__(self, signum: int):
        super().__init__(f"received {_signal_name(signum)}")
        self.signum = signum


@contextlib.contextmanager
def _signals_interrupt():
    """While a run is waited for (main thread only): SIGINT, SIGTERM and SIGHUP raise
    `Interrupted` once, so that the run is ended before samebits exits (their default would
    leave it running).  A signal whose handler is not the default (nohup's, a program's) is
    left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = []

    def handler(signum, frame):
        if not raised:
            raised.append(signum)
            raise Interrupted(signum)

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is None:
            continue
        current = signal.getsignal(signum)
        if current in (signal.SIG_DFL, signal.default_int_handler):
            previous[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)


def _die_with_parent():
    """Linux: a ``preexec_fn`` that has the kernel send the run SIGTERM when samebits dies, even
    by SIGKILL (``PR_SET_PDEATHSIG``; torchrun's agent then ends its workers).  None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # samebits died before the line above: nobody is left to end the run
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def end_process_tree(process: subprocess.Popen, grace: float = END_GRACE_S) -> None:
    """End a run with every process it started: SIGTERM to its group, each descendant and the
    groups they lead (torchrun's workers have sessions of their own), ``grace`` seconds, then
    SIGKILL.  Descendants are found in /proc while the run's first process lives (orphans are
    re-parented away from it)."""
    tree = _descendants(process.pid)
    _signal_tree(process.pid, tree, signal.SIGTERM)
    _signal_itself(process, signal.SIGTERM)  # a run that leads no group of its own (`run_attached`)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if process.poll() is None:
            tree.update(_descendants(process.pid))
        elif not any(_same_process(pid, started) for pid, started in tree.items()):
            break
        time.sleep(0.05)
    _signal_tree(process.pid, tree, signal.SIGKILL)
    _signal_itself(process, signal.SIGKILL)
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end (uninterruptible I/O)
        pass


def _signal_itself(process: subprocess.Popen, signum: int) -> None:
    if process.poll() is None:  # not yet reaped: the pid is still this run's
        try:
            process.send_signal(signum)
        except ProcessLookupError:
            pass


def _signal_tree(leader: int, tree: dict[int, int], signum: int) -> None:
    own = os.getpgrp()
    groups = {leader}
    for pid, started in tree.items():
        if _same_process(pid, started):
            try:
                groups.add(os.getpgid(pid))
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
    for group in groups - {own}:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _descendants(root: int) -> dict[int, int]:
    """``{pid: start time}`` of every living descendant of ``root`` (Linux /proc; {} elsewhere)."""
    children: dict[int, list[int]] = {}
    started: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry))
            started[int(entry)] = stat[1]
    found: dict[int, int] = {}
    pending = list(children.get(root, ()))
    while pending:
        pid = pending.pop()
        if pid not in found:
            found[pid] = started[pid]
            pending.extend(children.get(pid, ()))
    return found


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a living process, from /proc/PID/stat; None when it is gone
    or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            text = file.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


def _same_process(pid: int, started: int) -> bool:
    """Whether ``pid`` still is the process that started at ``started`` (not a reused pid)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[1] == started


def failed(label: str, argv: list[str], code: int, log: Path, *, why: str = "",
           outcomes: list[dict] = ()) -> RunFailed:
    """The error for a run that did not finish: what went wrong first, then its log's end."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.splitlines()
    first: list[str] = []
    for outcome in outcomes:
        if outcome.get("ended") in ("exception", "unreadable"):
            where = f"rank {outcome.get('rank')}" + (f", step {outcome['step']}" if outcome.get("step") is not None else "")
            first.append(f"{where}: {outcome.get('exception')}")
            first += ["    " + line for line in outcome.get("traceback_tail", [])]
    errors = list(dict.fromkeys(line.strip() for line in lines if _ERROR_LINE.match(line)))
    first += errors[:_TAIL_LINES]
    violations = list(dict.fromkeys(line.strip() for line in lines if _VIOLATION.match(line)))
    if violations:
        first.append("it refused to run: settings that break bitwise determinism:")
        first += ["  " + line for line in violations]
    reason = why or (first[0] if first else f"exited with code {code}")
    message = [f"run {label} failed ({shlex.join(argv)}): {why or f'exited with code {code}'}."]
    message += first
    tail = lines[-_TAIL_LINES:]
    message.append(f"the end of its log ({log}):")
    message += tail
    return RunFailed("\n".join(message), reason, label)


def judge_recorded_run(label: str, argv: list[str], code: int, run_dir: Path, log: Path) -> str | None:
    """Judge a zero-code run that exited with ``code``: None if it finished (exit 0), a line
    for the verdict's table if a crash after its code ended is tolerated, else `RunFailed`."""
    if code == 0:
        return None
    outcomes = read_outcomes(run_dir)
    if not outcomes:
        raise failed(label, argv, code, log, why=f"exited with code {code} before any process recorded a step",
                     outcomes=outcomes)
    raised = [o for o in outcomes if o.get("ended") != "clean"]
    if raised:
        first = raised[0]
        raise failed(label, argv, code, log, outcomes=outcomes,
                     why=f"rank {first.get('rank')} ended with an uncaught exception" if first.get("ended") ==
                     "exception" else f"rank {first.get('rank')}: {first.get('exception')}")
    killed_by = _signal_exit(code, log)
    if killed_by is None:
        raise failed(label, argv, code, log, outcomes=outcomes,
                     why=f"exited with code {code} after its code ended without an uncaught exception "
                         f"(sys.exit({code})?): a run that reports failure is not a finished run")
    try:
        run = open_run(run_dir)
        closed = run.closed_cleanly()
        ranks = set(run.ranks)
    except StreamError as err:
        raise failed(label, argv, code, log, why=f"killed by {killed_by} and its streams are unusable ({err})")
    ended = {o.get("rank") for o in outcomes}
    if not closed or not all(o.get("streams_closed") for o in outcomes) or not ranks <= ended:
        raise failed(label, argv, code, log, why=f"killed by {killed_by} before every rank closed its streams")
    return (f"crashed at teardown ({killed_by}) after its code ended cleanly and every stream closed: "
            "records kept")


def teardown_note(label: str, code: int, out_dir: Path, log: Path) -> str | None:
    """`judge_recorded_run` for callers without the command: the tolerance line, or None when
    the run must be reported as failed (then call `failed`)."""
    try:
        return judge_recorded_run(label, [], code, Path(out_dir), log)
    except RunFailed:
        return None


def _signal_exit(code: int, log: Path) -> str | None:
    """The signal that ended the run, if its exit code says one did (directly, as a shell's
    128+N, or in torchrun's summary where every failed worker's exitcode is negative)."""
    if code < 0:
        return _signal_name(-code)
    if 128 < code < 128 + 65:
        return _signal_name(code - 128)
    worker_codes = [int(c) for c in _WORKER_EXIT.findall(log.read_text(errors="replace"))] if log.exists() else []
    if worker_codes and all(c < 0 for c in worker_codes):
        return ", ".join(sorted({_signal_name(-c) for c in worker_codes}))
    return None


STOPPED = "stopped"  # the verdict word of a summary.json whose command did not finish (exit 3)
UNFINISHED = ("the command did not finish: it was killed (SIGKILL, or its machine went away) or is still running; "
              "the runs listed are those that had ended")


def write_stopped(out: Path, runs: list, reason: str) -> Path:
    """``out``/summary.json of a command that has not finished: verdict "stopped" (exit 3, never a
    verdict on the runs), why, and the `RunInfo` of the runs that had ended."""
    data = {"verdict": STOPPED, "exit_code": 3, "stopped": reason, "out": str(out),
            "runs": [run.to_dict() if hasattr(run, "to_dict") else dict(run) for run in runs]}
    path = Path(out) / "summary.json"
    tmp = path.with_name(path.name + ".tmp")
    # ensure_ascii: a path that is not UTF-8 is kept as an escape, never an encoding error
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)  # whole or not at all: a kill mid-write leaves the previous one
    return path


@contextlib.contextmanager
def stopped_marked(out: Path, runs: list):
    """While a command's runs go, ``out``/summary.json says "stopped" with the runs that ended
    (the yielded ``mark()`` after each), which is what a SIGKILL leaves; an interruption or a run
    that did not finish writes why before it propagates."""
    def mark(reason: str = UNFINISHED) -> None:
        write_stopped(out, runs, reason)

    mark()
    try:
        yield mark
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        mark(f"stopped by {_signal_name(signum)} (exit {128 + signum}); the runs it had started were ended")
        raise
    except RunFailed as err:
        mark(f"run {err.label or '?'} did not finish: {err.reason}")
        raise
    except Exception as err:
        mark(f"stopped by an error: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        raise


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


__all__ = ["run_logged", "stopped_marked", "write_stopped", "STOPPED", "end_process_tree", "Interrupted", "END_GRACE_S", "failed", "judge_recorded_run", "RunFailed", "teardown_note",
           "DEFAULT_TIMEOUT_S"]
