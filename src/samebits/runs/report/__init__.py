"""`samebits report`: one self-contained HTML page of what a verify, bisect, matrix or diff found.

The page is built from what is on disk, never from memory of a run: the summary a command
wrote (``summary.json`` of `samebits verify`, `bisect` or `matrix`) and the streams of its runs,
which are compared again here with `samebits.compare` (every frame checked, every root
recomputed), so the page shows evidence it re-derived rather than copied.  Two run directories
are compared directly.

The page leads with the command's conclusion, the sentence the terminal printed
(`samebits.runs.conclusion`).  Then, per compared pair of runs: the verdict; the growth of the
difference in ulps per step (log scale, per metric, exact from the recorded bits; tensors are
digests only, so params, grads and optimizer state get the steps where they differ and the page
says no magnitude is known); the metric curves of both runs (loss, grad norm, lr: a solid, b
dashed, with a legend naming the runs); a heatmap of where the runs differ (records x steps for
one or two ranks, ranks x steps, binned, for many); which records differ at each step after the
first divergence; the origin of a bisection with its call site and element detail (from the
bisection's own element dumps); the difference between the runs' recorded environments and
configs.  Steps a run never ran because the live check stopped it at its first divergence are
shown as such ("not run past the first divergence"), never as a difference.

One file, no network: inline CSS, charts as inline SVG generated here, no script at all, and a
Content-Security-Policy that forbids scripts and remote loads.  Every name and value passes
through `_esc` (HTML-escaped, control characters shown as ``\\xNN``): tensor names, config values
and paths come from files and runs, and a name like ``<img src=x onerror=...>`` must stay text.
"""

from __future__ import annotations

from samebits.runs.report.build import build_report, write_report
from samebits.runs.report.evidence import Pair, differing_records
from samebits.runs.report.page import Report


__all__ = ["build_report", "write_report", "differing_records", "Report", "Pair"]
