"""`samebits report`: one self-contained HTML page of what a verify, bisect, matrix or diff found.

The page is built from what is on disk, never from a run's memory: the summary a command wrote
and its runs' streams, compared again here, so it shows evidence it re-derived rather than
copied; it leads with the terminal's sentence (`samebits.runners.conclusion`).  What each section
shows: docs/report.md.  One file, no network, no script (a Content-Security-Policy forbids
them); every name and value passes through `_esc`, since names come from files and runs.
"""

from __future__ import annotations

from samebits.runners.report.build import build_report, write_report
from samebits.runners.report.evidence import Pair, differing_records
from samebits.runners.report.page import Report


__all__ = ["build_report", "write_report", "differing_records", "Report", "Pair"]
