"""The comparator: are two runs bitwise identical, and if not, where did they first part?

`diff(a, b)` streams both runs rank by rank.  Nothing stored is trusted: every frame's
checksum is checked and every step root is recomputed from the step's records by the
reader (a damaged stream is a `StreamError`, never a verdict).  Steps whose recomputed
roots (and record counts) agree are equal without decoding; the first step that differs
on a rank is decoded and its records are matched by identity (kind, phase, name,
occurrence), never by position.  `divergent_steps` is that same walk, yielding each rank's
first divergent step.  The result is a `DiffResult`, the same object `samebits diff
--json` prints; its verdict is IDENTICAL only when every selected step of every rank of the
world was compared in two complete streams.

The package face only re-exports: `_diff` (diff, divergent_steps), `_walk` (one rank's step
walk), `_results` (the result types), `_rule` (when two records match), `_commands` (command
lines that differ only in outputs), `_global` (`--by global`), `_parallel` (ranks in processes).
"""

from __future__ import annotations

from samebits.compare._commands import output_paths_only
from samebits.compare._diff import diff, divergent_steps
from samebits.compare._global import GlobalDiffResult, GlobalTensorResult
from samebits.compare._results import DiffResult, Divergence, RankStep
from samebits.compare._rule import DIFFERS, EQUAL, SHAPE_ONLY, record_match

__all__ = ["diff", "divergent_steps", "record_match", "EQUAL", "DIFFERS", "SHAPE_ONLY",
           "DiffResult", "Divergence", "RankStep", "GlobalDiffResult",
           "GlobalTensorResult", "output_paths_only"]
