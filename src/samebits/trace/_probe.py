"""Rung 4: probes at boundaries the dispatcher cannot see (Triton kernels, custom autograd
functions, C++ extensions): `TraceProbe` as a decorator or a ``with`` block (docs/tracing.md).

A probe records an event ``<scope>/probe:<name>:<n>`` when the tracer is at rung 2 or above
inside the traced subtree; otherwise it costs one attribute check.  (`samebits.probe` is
another thing: it runs every op twice to find the ops that really vary.)
"""

from __future__ import annotations

import functools

from samebits.errors import ConfigError
from samebits.trace import _tracer
from samebits.trace._config import source_prefix
from samebits.trace._tracer import _labelled as _leaves


class TraceProbe:
    """Record inputs and outputs at a boundary; use as a decorator or a context manager."""

    def __init__(self, name: str, *inputs, **named_inputs):
        if not name or "/" in name or "|" in name:
            raise ConfigError(f"probe name {name!r} must be non-empty without '/' or '|'.")
        self.name = name
        self._inputs = _leaves(list(inputs)) + _leaves(named_inputs)
        self._event = None

    def __call__(self, fn):
        @functools.wraps(fn)
        def probed(*args, **kwargs):
            with TraceProbe(self.name, *args, **kwargs) as p:
                result = fn(*args, **kwargs)
                p.outputs(result)
            return result

        return probed

    def __enter__(self) -> "TraceProbe":
        tracer = _tracer.active()
        state = tracer.now if tracer is not None else None
        if state is None or tracer.busy or (state.level < 2 and not state.special):
            return self
        phase = tracer.current_phase()
        scope = state.scope
        n = state.next_number("probe", (phase, scope, self.name))
        event_id = f"{scope}/probe:{self.name}:{n}"
        recorded = state.level >= 2 and tracer.config.in_subtree(scope)
        _, dump = tracer.special_for(event_id, phase) if state.special else (False, False)
        if recorded:
            fresh = state.unseen(self._inputs)
            tracer.record("probe", event_id, "in", fresh, phase)
            state.mark_all_seen(fresh, source_prefix(phase, event_id, "in"))
        dump_inputs = tracer.copies(self._inputs) if dump else None
        self._event = (tracer, state, tracer.step_now, event_id, phase, recorded, dump_inputs)
        return self

    def outputs(self, *values) -> None:
        """Declare the region's outputs (tensors, or lists/tuples/dicts of them)."""
        if self._event is None:
            return
        tracer, state, step, event_id, phase, recorded, dump_inputs = self._event
        self._event = None
        if tracer.now is not state or tracer.step_now != step:
            return
        pairs = _leaves(values[0] if len(values) == 1 else list(values))
        if recorded:
            tracer.record("probe", event_id, "out", pairs, phase)
            state.mark_all_seen(pairs, source_prefix(phase, event_id, "out"))
        if dump_inputs is not None:
            tracer.dump(event_id, phase, f"probe:{self.name}", dump_inputs, pairs, None)

    def __exit__(self, *exc) -> None:
        self._event = None
