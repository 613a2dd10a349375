"""Rung 3: every ATen op through a `TorchDispatchMode`, with ids that do not depend on order.

An op's id is ``<scope>/<op>:<n>`` (innermost module FQN, schema name, occurrence among ops of
that name, scope and training phase in the step), so ops elsewhere never shift an id.  Each
tensor *version* is recorded once per step, as the output that wrote it or as an input of its
first traced consumer; digests stay on the device until the step ends.  Uninitialised
outputs, in-flight collective buffers, views and ``c10d`` ops are never recorded as values
(docs/tracing.md, "Record names and ids").
"""

from __future__ import annotations

import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samebits._torchutil import call_site, is_uninitialized_op, op_tensor_args, op_tensor_outputs
from samebits.trace._config import ORDER_LABEL, SET_LABEL, record_name, source_prefix
from samebits.trace._tensors import TRACE_DIR, digestable, geometry, version_of

NORMAL, SKIP, NOISE, VIEW = 0, 1, 2, 3
_SKIP_NAMESPACES = {"c10d", "profiler", "record_function"}


class _OpInfo:
    __slots__ = ("name", "kind", "writes")

    def __init__(self, func):
        schema = func._schema
        self.name = schema.name
        namespace = self.name.partition("::")[0]
        self.writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if namespace in _SKIP_NAMESPACES:
            self.kind = SKIP
        elif (is_uninitialized_op(self.name)
              or (namespace == "_c10d_functional" and self.name != "_c10d_functional::wait_tensor")):
            self.kind = NOISE
        elif func.is_view:
            self.kind = VIEW
        else:
            self.kind = NORMAL


class OpMode(TorchDispatchMode):
    """The tracer's dispatch mode; pushed only for the steps rung 3 (or a test hook) needs.
    samebits' own torch work passes straight through (`Tracer.suspended()`)."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer
        self._info: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        t = self.tracer
        s = t.now
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _OpInfo(func)
        if t.busy or s is None or info.kind == SKIP:
            return func(*args, **kwargs)
        phase = t.current_phase()
        if phase == "backward":
            entry = s.autograd.running()
            scope, site = entry if entry is not None else ("", None)
        else:
            scope, site = s.scope, None
        name = info.name
        n = s.next_number("op", (phase, scope, name))
        g = s.next_number("global_op", name)
        event_id = f"{scope}/{name}:{n}"
        recorded = s.level >= 3 and (not t.config.module or t.config.in_subtree(scope))
        perturb = dump = False
        if s.special:
            perturb, dump = t.special_for(event_id, phase, f"{name}:{g}")
        if phase != "backward":
            if recorded and t.config.call_sites:
                site = call_site(2, skip=(TRACE_DIR, "<"))
                s.note_call_site(phase, event_id, site)
            s.autograd.created((scope, site))  # the autograd node this op created, if any, is named after it
        elif recorded:
            s.note_call_site(phase, event_id, site)

        if info.kind != NORMAL or not (recorded or perturb or dump):
            out = func(*args, **kwargs)
            if recorded:
                _note_unrecorded(s, info.kind, phase, event_id, args, kwargs, out)
            return out

        inputs = op_tensor_args(args, kwargs)
        lists = _list_arguments(inputs, s) if recorded else None
        if info.writes and recorded:  # the op may overwrite an input: digest inputs first
            pre = [(record_name(event_id, "in", label), x) for label, x in inputs
                   if digestable(x) and not s.is_seen(x)]
            s.mark_all_seen(pre, phase + "|")  # a fresh input's source is its record
            if lists:
                pre += _provenance(t, s, event_id, lists)
            if pre:
                t.record_named("op", phase, pre)
        versions = [version_of(x) for _, x in inputs] if info.writes else None
        dump_inputs = t.copies(inputs) if dump else None  # before the op: it may write into them

        out = func(*args, **kwargs)

        outputs = op_tensor_outputs(out)
        if info.writes:  # arguments written in place are outputs too
            returned = {id(o) for _, o in outputs}
            for (label, x), before in zip(inputs, versions):
                if id(x) not in returned and version_of(x) != before:
                    outputs.append((f"arg{label}", x))
        if perturb and outputs:
            t.nudge(outputs[0][1])
        if recorded:
            named = []
            if not info.writes:
                named = [(record_name(event_id, "in", label), x) for label, x in inputs
                         if digestable(x) and not s.is_seen(x)]
                s.mark_all_seen(named, phase + "|")
                if lists:
                    named += _provenance(t, s, event_id, lists)
            named += [(record_name(event_id, "out", label), o) for label, o in outputs]
            t.record_named("op", phase, named)
            s.mark_all_seen(outputs, source_prefix(phase, event_id, "out"))
            s.mark_all_seen(inputs, source_prefix(phase, event_id, "in"))
        if dump:
            t.dump(event_id, phase, name, dump_inputs, outputs, site)
        return out


def _note_unrecorded(s, kind, phase: str, event_id: str, args, kwargs, out) -> None:
    """What a recorded scope's op that is not recorded (noise, a view) tells the step's seen
    tensors: noise outputs are seen as the op's; a view of seen tensors is seen while they are."""
    if kind == NOISE:
        s.mark_all_seen(op_tensor_outputs(out), source_prefix(phase, event_id, "out"))
    elif kind == VIEW:
        viewed = op_tensor_args(args, kwargs)
        if viewed and all(s.is_seen(x) for _, x in viewed):
            # A view's bytes are its input's: its source is the input's, where it sits
            # (never the view op's id, which counts in call order).
            base = s.source_of(viewed[0][1])
            for _, o in op_tensor_outputs(out):
                s.mark_view(o, viewed[0][1], None if base is None else base + geometry(o))


def _list_arguments(inputs: list, state) -> dict[str, list]:
    """The op's list arguments of two tensors or more (labels ``"0.3"``, ``"key.1"``) that hold
    a tensor already recorded in the step: their order is checked by provenance."""
    groups: dict[str, list] = {}
    for label, x in inputs:
        head, dot, _ = label.partition(".")
        if dot:
            groups.setdefault(head, []).append(x)
    return {head: items for head, items in groups.items()
            if len(items) > 1 and any(state.is_seen(x) for x in items)}


def _provenance(tracer, state, event_id: str, lists: dict[str, list]) -> list:
    """Two small records per list argument: the sources of its tensors (a hash of the record
    that first held each one: `StepState.source_of`) sorted (``in:<arg>@set``: which tensors)
    and in argument order (``in:<arg>@order``).  A tensor recorded before is not recorded
    again as an input, so without them an op given the same tensors in another order (a list
    built from a Python set) would look like an op whose inputs all matched."""
    named = []
    with tracer.suspended():
        for head, items in lists.items():
            hashes = [_source_hash(state.source_of(x)) for x in items]
            named.append((record_name(event_id, "in", head + SET_LABEL), torch.tensor(sorted(hashes), dtype=torch.int64)))
            named.append((record_name(event_id, "in", head + ORDER_LABEL), torch.tensor(hashes, dtype=torch.int64)))
    return named


def _source_hash(source: str | None) -> int:
    return 0 if source is None else zlib.crc32(source.encode())
