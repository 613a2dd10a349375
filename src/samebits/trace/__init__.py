"""Divergence tracing: find the op where two runs first part, and say whether it is the origin.

Rungs, cheapest first (phases, modules, ops), all written into the run's ordinary per-rank
streams; docs/tracing.md has the record layout, the ids and what each rung cannot see.
`attach_from_env` gives an explicit loop its tracer (off unless ``SAMEBITS_TRACE=...``),
zero-code recording installs the same one, and `find_origins` compares two traced runs.
"""

from __future__ import annotations

import contextlib
import warnings

from samebits.trace._config import ENV_VARS, LEVEL_NAMES, EventSpec, TraceConfig, parent_scope, parse_record
from samebits.trace._elements import compare_elements, same_values
from samebits.trace._origin import (OriginFinding, OriginReport, ReplicaMismatch, describe_record, find_origins,
                                    find_replica_mismatch)
from samebits.trace._probe import TraceProbe
from samebits.trace._step import StepState
from samebits.trace._tracer import Tracer, _set_active, active, dump_filename


class _Off:
    """The handle `attach_from_env` returns when tracing is off: every call is free."""

    config = TraceConfig()

    def step(self, step: int):
        return contextlib.nullcontext(self)

    def suspended(self):
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


OFF = _Off()


def attach(model, recorder, config: TraceConfig | None = None) -> "Tracer | _Off":
    """Trace `model`'s training into `recorder`'s streams according to `config`.

    Returns a handle: wrap each step in ``with handle.step(step):``, call ``handle.close()`` at
    the end (a later `attach` closes a tracer left open); ``handle.suspended()`` runs torch work
    of your own untraced.  Its records are finished before the recorder writes the step.
    """
    config = config or TraceConfig()
    if not config.enabled:
        return OFF
    if recorder is None or not getattr(recorder, "active", True):
        warnings.warn("samebits.trace: tracing is configured but there is no active recorder to write "
                      "into; tracing is off (give the run an output directory)", stacklevel=2)
        return OFF
    if active() is not None:  # one tracer per process: a loop that ended without close() left it
        active().close()
    tracer = Tracer(config, recorder=recorder)
    if model is not None:
        tracer.add_root(model)
    tracer.install_permanent()
    _set_active(tracer)
    return tracer


def attach_from_env(model, recorder) -> "Tracer | _Off":
    """`attach` with the ``SAMEBITS_TRACE*`` variables' configuration (off when unset)."""
    return attach(model, recorder, TraceConfig.from_env())


def install_zero_code(recorder_source, step: int) -> "Tracer | None":
    """For `samebits.autorecord`: trace into the recorder ``recorder_source()`` creates lazily;
    the caller drives `Tracer.begin_step` / `optimizer_post` / `finish_step` / `after_end_step`."""
    config = TraceConfig.from_env()
    if not config.enabled or active() is not None:
        return None
    tracer = Tracer(config, recorder_source=recorder_source, zero_code=True)
    tracer.install_permanent()
    _set_active(tracer)
    tracer.begin_step(step)
    return tracer


__all__ = ["TraceConfig", "EventSpec", "Tracer", "attach", "attach_from_env", "TraceProbe", "StepState",
           "find_origins", "OriginReport", "OriginFinding", "compare_elements", "same_values", "active",
           # for the runs layer (bisect): the settings it launches runs with, the records it reads
           "ENV_VARS", "LEVEL_NAMES", "parent_scope", "parse_record", "describe_record", "dump_filename",
           "find_replica_mismatch", "ReplicaMismatch"]
