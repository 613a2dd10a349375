"""Fingerprint streams: one ordered, append-only, crash-safe stream per rank per run.

`Recorder` writes (what it records: a `RecordingSpec`), `open_run` / `StreamReader` read.
The byte layout is in `_format` and docs/stream.md.
"""

from samebits._lazy_exports import lazy_exports

# Imported from their modules on first use (PEP 562): reading a stream (`open_run`, `summarise`)
# loads no torch, writing one (`Recorder`) does.
_LAZY = {
    "Record": "reader", "Run": "reader", "StepBlock": "reader", "StreamReader": "reader", "open_run": "reader",
    "StreamHeader": "header", "GLOBAL_PHASE_PREFIX": "phases", "STEP_TIMES_SUFFIX": "recorder", "Recorder": "recorder",
    "RecordingSpec": "recorder", "CatalogueEntry": "summary", "catalogue": "summary", "summarise": "summary",
    # Internal but stable, not in __all__: the comparator recomputes step roots (docs/stream.md).
    "step_root": "_format",
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["Recorder", "RecordingSpec", "Record", "Run", "StepBlock", "StreamHeader", "StreamReader", "open_run", "summarise",
           "catalogue", "CatalogueEntry", "GLOBAL_PHASE_PREFIX", "STEP_TIMES_SUFFIX"]
