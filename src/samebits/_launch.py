"""Running one training command for verify and bisect: logged, bounded, and judged.

A run's output goes to a log file (its first line is the command); a run that hangs past
its time limit is killed with every process it started; a run that fails says so with the
end of its log.  A run that exits non-zero *after* closing every stream (seen with gloo
at process teardown) keeps its records, with a note, since every bit we compare is there.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

from samebits.errors import SamebitsError

DEFAULT_TIMEOUT_S = 1800.0


def run_logged(argv: list[str], log: Path, *, env: dict | None = None, header: str = "",
               timeout: float | None = DEFAULT_TIMEOUT_S, label: str = "") -> tuple[int, float]:
    """Run ``argv`` with its output in ``log``; return (exit code, seconds)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as handle:
        handle.write("$ " + (header + " " if header else "") + shlex.join(argv) + "\n")
        handle.flush()
        try:
            process = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        except FileNotFoundError:
            raise SamebitsError(f"cannot run {argv[0]!r}: no such program. Check the command.") from None
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the run and every process it started
            process.wait()
            raise SamebitsError(f"run {label} ({shlex.join(argv)}) did not finish within {timeout:.0f} s "
                                f"(a hang, e.g. ranks waiting on each other); its log: {log}. Raise "
                                "--run-timeout if it is merely slow.") from None
    return code, time.perf_counter() - start


def failed(label: str, argv: list[str], code: int, log: Path) -> SamebitsError:
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
    return SamebitsError(f"run {label} ({shlex.join(argv)}) exited with code {code}; the end of its log "
                         f"({log}):\n{tail}")


def teardown_note(label: str, code: int, out_dir: Path, log: Path) -> str | None:
    """A note if a run that exited with ``code`` still closed every stream, else None."""
    from samebits.stream.reader import open_run

    try:
        complete = open_run(out_dir).closed_cleanly()
    except SamebitsError:
        return None
    if not complete:
        return None
    return (f"run {label} exited with code {code} after closing all its streams (a crash at process "
            f"teardown); its records are complete. Log: {log}")
