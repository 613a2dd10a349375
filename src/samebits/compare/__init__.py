"""The comparator: are two runs bitwise identical, and if not, where did they first part?

`diff(a, b)` verifies both runs' streams, decides equal steps by their recomputed roots and
matches a differing step's records by identity, never by position (docs/stream.md, "The
comparator").  This face only re-exports: the engine is `_diff`, the walk `_walk`, the result
types `_results`, the rule `_rule`, `--by global` `_global`, the parallel walks `_parallel`.
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
