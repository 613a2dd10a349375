"""Fail-safe recording: samebits' code inside the user's process never reaches the program.

Every hook zero-code recording installs runs its own work inside ``with guard(site, step=...,
records=...)``: an exception there is swallowed and recorded as a **gap** (a line in
``SAMEBITS_DIR/gaps-rank-NNNNN.jsonl``, the traceback once per site in
``samebits-log-rank-NNNNN.txt``); the user's own code always runs outside the guard.
`read_gaps` gives them to the launcher: a verdict touching a gap at a ``verdict=True`` site is
INCOMPLETE.  ``SAMEBITS_TEST_FAULT_SITE`` (tests only) makes a site raise (docs/resume.md).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

GAPS_FILE = "gaps-rank-{rank}.jsonl"  # in the run directory, one JSON line per gap
LOG_FILE = "samebits-log-rank-{rank}.txt"  # the traceback of each site's first gap
MAX_GAPS = 1_000  # a site that fails every step: its first gaps are enough
FAULT_VARIABLE = "SAMEBITS_TEST_FAULT_SITE"  # tests: make this site raise (comma-separated)

#: Every hook site, with whether a gap there touches the verdict (it writes the main stream).
SITES: dict[str, bool] = {
    "startup": True,  # install(): nothing is recorded in this process
    "forward_pre": False,  # census and inputs at a top-level forward
    "forward": True,  # a top-level forward's outputs
    "backward": True,  # the root of a backward() call
    "optimizer_step": True,  # params, grads, optimizer state after a step
    "step_end": True,  # the step's end (the frame written)
    "census": False,  # the state census
    "tracking": False,  # constructor wrappers, generator and data-loader tracking
    "exit": True,  # closing the streams at exit
}


class InjectedFault(RuntimeError):
    """Raised at a site named in ``SAMEBITS_TEST_FAULT_SITE`` (fault-injection tests only)."""


class _Gaps:
    def __init__(self):
        self.count = 0
        self.logged: set[str] = set()
        self.faults = {s.strip() for s in os.environ.get(FAULT_VARIABLE, "").split(",") if s.strip()}

    def directory(self) -> Path | None:
        directory = os.environ.get("SAMEBITS_DIR", "").strip()
        return Path(directory) if directory else None


_GAPS = _Gaps()


def _rank() -> str:
    rank = os.environ.get("RANK", "").strip()  # unset: one process, which records as rank 0
    return f"{int(rank) if rank.isdigit() else 0:05d}"


def record_gap(site: str, error: BaseException, *, step: int | None = None, records: str = "") -> None:
    """Note that samebits could not record ``records`` at ``site`` in ``step`` because of
    ``error``.  Never raises: when even this fails, a line on stderr is all that is left."""
    try:
        _GAPS.count += 1
        if _GAPS.count > MAX_GAPS:
            return
        directory = _GAPS.directory()
        message = f"{type(error).__name__}: {error}"
        entry = {"site": site, "step": step, "records": records or site, "error": message[:2000],
                 "verdict": SITES.get(site.partition(".")[0], True), "pid": os.getpid()}
        if directory is None:
            print(f"samebits: could not record {entry['records']} at {site} (step {step}): {message}",
                  file=sys.stderr)
            return
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / GAPS_FILE.format(rank=_rank()), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
        if site not in _GAPS.logged:
            _GAPS.logged.add(site)
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            with open(directory / LOG_FILE.format(rank=_rank()), "a", encoding="utf-8") as handle:
                handle.write(f"--- samebits could not record {entry['records']} at {site}, step {step} "
                             f"(pid {os.getpid()}); a samebits bug, please report it with this log ---\n{text}\n")
    except Exception:  # noqa: BLE001 - the last resort: a line on stderr, the program untouched
        try:
            print(f"samebits: could not record at {site}: {error!r}", file=sys.stderr)
        except Exception:  # noqa: BLE001
            pass


def inject(site: str) -> None:
    """Raise `InjectedFault` if ``SAMEBITS_TEST_FAULT_SITE`` names ``site`` (for a site that fails
    by raising to its caller, such as ``startup``)."""
    if site in _GAPS.faults:
        raise InjectedFault(f"samebits fault injected at {site} ({FAULT_VARIABLE})")


class guard:  # noqa: N801 - used as a statement: ``with guard(site):``
    """Run samebits' own work; an exception it raises (an injected fault too) becomes a gap
    (`record_gap`) and goes no further.  ``site``: one of `SITES`, maybe with a detail."""

    __slots__ = ("site", "step", "records")

    def __init__(self, site: str, *, step: int | None = None, records: str = ""):
        self.site, self.step, self.records = site, step, records

    def __enter__(self) -> "guard":
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            if not _GAPS.faults or not (self.site in _GAPS.faults or self.site.partition(".")[0] in _GAPS.faults):
                return False
            error = InjectedFault(f"samebits fault injected at {self.site} ({FAULT_VARIABLE})")
        elif not issubclass(kind, Exception):
            return False  # KeyboardInterrupt, SystemExit: the program's, never swallowed
        record_gap(self.site, error, step=self.step, records=self.records)
        return True  # the contract: nothing of ours reaches the program


def read_gaps(run_dir: str | os.PathLike) -> list[dict]:
    """Every gap recorded in run ``run_dir`` (all ranks), in file order; an unreadable line
    is itself a gap (``site`` "unreadable"), so that it is never taken for none."""
    run_dir = Path(run_dir)
    gaps: list[dict] = []
    if not run_dir.is_dir():
        return gaps
    for path in sorted(run_dir.glob(GAPS_FILE.format(rank="*"))):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError as err:
            gaps.append({"site": "unreadable", "step": None, "records": path.name, "error": str(err),
                         "verdict": True, "file": str(path)})
            continue
        rank = path.name[len("gaps-rank-"):-len(".jsonl")]
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                entry = None
            if not isinstance(entry, dict):
                entry = {"site": "unreadable", "step": None, "records": path.name, "error": "a damaged line",
                         "verdict": True}
            entry["rank"] = int(rank) if rank.isdigit() else None
            entry["log"] = str(run_dir / LOG_FILE.format(rank=rank))
            gaps.append(entry)
    return gaps


def summarise_gaps(gaps: list[dict]) -> str:
    """One line: what samebits could not record, and where the log is."""
    if not gaps:
        return ""
    sites = list(dict.fromkeys(f"{g.get('records') or g.get('site')} ({g.get('site')})" for g in gaps))
    steps = sorted({g["step"] for g in gaps if isinstance(g.get("step"), int)})
    where = f" from step {steps[0]}" if steps else ""
    more = f" and {len(sites) - 3} more" if len(sites) > 3 else ""
    return (f"samebits could not record {', '.join(sites[:3])}{more}{where}: a samebits bug, please report it "
            f"with {gaps[0].get('log', 'the run log')}")
