"""Fingerprint streams: one ordered, append-only, crash-safe stream per rank per run.

`Recorder` writes, `open_run` / `StreamReader` read.  The byte layout is in `_format`
and docs/stream.md.
"""

from samebits.stream.reader import Record, Run, StepBlock, StreamReader, open_run
from samebits.stream.summary import CatalogueEntry, catalogue, summarise
from samebits.stream.writer import Recorder

__all__ = ["Recorder", "Record", "Run", "StepBlock", "StreamReader", "open_run", "summarise", "catalogue",
           "CatalogueEntry"]
