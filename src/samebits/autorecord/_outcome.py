"""How each recorded process's own code ended, written next to its stream for the launcher.

An exit code cannot tell "raised at step 3" from "finished, then crashed in teardown", and
both leave complete-looking streams.  So each process that recorded writes
``outcome-rank<R>-pid<P>.json`` atomically as its code ends: ``clean``, ``exception`` (with
the traceback tail) or ``stopped`` (the live check).  `samebits.runners._launch` keeps a run's
records only when every process ended ``clean`` with its streams closed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from samebits.stream.reader import STOPPED_MARKER
from samebits.stream.reader import read_stop_marker as read_stop  # the live check's marker; the comparator reads it too

OUTCOME_PREFIX = "outcome-"
TRACEBACK_LINES = 8  # lines of the traceback's end kept in the outcome file


def write_outcome(directory: str | os.PathLike, *, rank: int | None, ended: str,
                  streams_closed: bool, exception: str = "", traceback_tail: list[str] = (),
                  step: int | None = None) -> Path:
    """Write this process's outcome file into ``directory`` and return its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    name = f"{OUTCOME_PREFIX}rank{rank if rank is not None else 'x'}-pid{pid}.json"
    payload = {"pid": pid, "rank": rank, "ended": ended, "streams_closed": streams_closed,
               "step": step, "exception": exception, "traceback_tail": list(traceback_tail)}
    temporary = directory / (name + ".tmp")
    temporary.write_text(json.dumps(payload) + "\n")
    os.replace(temporary, directory / name)
    return directory / name


def read_outcomes(directory: str | os.PathLike) -> list[dict]:
    """Every outcome file in ``directory`` (sorted by rank, then pid); an unreadable one is
    returned as ``{"ended": "unreadable", ...}`` so that it is never taken for a clean end."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    outcomes = []
    for path in sorted(directory.glob(OUTCOME_PREFIX + "*.json")):
        try:
            outcome = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            outcome = {"ended": "unreadable", "rank": None, "exception": f"{path.name}: {err}"}
        if not isinstance(outcome, dict):
            outcome = {"ended": "unreadable", "rank": None, "exception": f"{path.name}: not a JSON object"}
        outcome["file"] = str(path)
        outcomes.append(outcome)
    outcomes.sort(key=lambda o: (o.get("rank") if isinstance(o.get("rank"), int) else -1, o.get("pid") or 0))
    return outcomes


def write_stop(directory: str | os.PathLike, *, step: int, rank: int | None, reference: str = "",
               reason: str = "diverged from reference") -> None:
    """Leave the stop marker (atomically; the first rank to stop wins, later ones keep it)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f"{STOPPED_MARKER}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps({"stopped_at": step, "rank": rank, "reference": str(reference),
                                     "reason": reason}) + "\n")
    try:
        os.link(temporary, directory / STOPPED_MARKER)  # fails if another rank already wrote it
    except FileExistsError:
        pass
    except OSError:  # a file system without hard links
        os.replace(temporary, directory / STOPPED_MARKER)
        return
    temporary.unlink(missing_ok=True)
