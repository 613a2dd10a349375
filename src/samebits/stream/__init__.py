"""Fingerprint streams: one ordered, append-only, crash-safe stream per rank per run.

`Recorder` writes (what it records: a `RecordingSpec`), `open_run` / `StreamReader` read.
The byte layout is in `_format` and docs/stream.md.
"""

from samebits.stream.reader import Record, Run, StepBlock, StreamReader, open_run
from samebits.stream.recorder import GLOBAL_PHASE_PREFIX, STEP_TIMES_SUFFIX, Recorder, RecordingSpec
from samebits.stream.summary import CatalogueEntry, catalogue, summarise

# Internal but stable, not in __all__: the comparator recomputes step roots (docs/stream.md).
from samebits.stream._format import step_root  # noqa: F401

__all__ = ["Recorder", "RecordingSpec", "Record", "Run", "StepBlock", "StreamReader", "open_run", "summarise",
           "catalogue", "CatalogueEntry", "GLOBAL_PHASE_PREFIX", "STEP_TIMES_SUFFIX"]
