"""Rung 3: every ATen op through a `TorchDispatchMode`, with ids that do not depend on order.

An op's id is ``<scope>/<op>:<n>``: scope is the FQN of the innermost module running it
(in backward: the module whose forward created the autograd node being run), op the
schema name (``aten::mm``), n its occurrence among ops of that name, scope and training
phase in this step.  Ops elsewhere in the program never shift an id, so two runs whose
control flow differs in one module keep comparable ids everywhere else.

Each tensor *version* is recorded once per step: as the output of the op that wrote it,
or as an input of its first traced consumer when untraced code wrote it.  Inputs of ops
that write into an argument are digested before the op runs; all others after it, in the
same Recorder call as the outputs (one call per op).  Digests stay on the device until the
step ends.

Noise filter (never recorded as values): outputs of ``empty*``/``new_empty*``/``resize_``/
``set_`` (uninitialised memory), outputs of the asynchronous functional collectives before
``wait_tensor`` (in-flight buffers), view ops (their bytes are their base's), and the
``c10d`` ops (recorded by the collective wrapper, with completion handled).  Filtered
outputs count as seen, so their first consumer does not record the garbage either.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samebits.trace._config import record_name
from samebits.trace._tensors import _TORCH_DIR, _TRACE_DIR, call_site, digestable, nudge, version_of

_LIBRARY_DIR = os.path.dirname(_TRACE_DIR) + os.sep  # samebits itself ...
_CLIENT_DIR = os.path.join(_LIBRARY_DIR, "recipes") + os.sep  # ... but the recipe is traced like a user's code

NORMAL, SKIP, NOISE, VIEW = 0, 1, 2, 3
_SKIP_NAMESPACES = {"c10d", "profiler", "record_function"}
_NOISE_PREFIXES = ("aten::empty", "aten::new_empty", "aten::_empty")
_NOISE_NAMES = {"aten::resize_", "aten::resize_as_", "aten::_resize_output_", "aten::set_"}
_get_sequence_nr = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node


class _OpInfo:
    __slots__ = ("name", "kind", "writes")

    def __init__(self, func):
        schema = func._schema
        self.name = schema.name
        namespace = self.name.partition("::")[0]
        self.writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if namespace in _SKIP_NAMESPACES:
            self.kind = SKIP
        elif (self.name.startswith(_NOISE_PREFIXES) or self.name in _NOISE_NAMES
              or (namespace == "_c10d_functional" and self.name != "_c10d_functional::wait_tensor")):
            self.kind = NOISE
        elif func.is_view:
            self.kind = VIEW
        else:
            self.kind = NORMAL


def _flat_inputs(args, kwargs) -> list:
    flat = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            flat.append((str(i), a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor):
                    flat.append((f"{i}.{j}", b))
    for key, a in kwargs.items():
        if isinstance(a, torch.Tensor):
            flat.append((key, a))
        elif isinstance(a, (list, tuple)):
            for j, b in enumerate(a):
                if isinstance(b, torch.Tensor):
                    flat.append((f"{key}.{j}", b))
    return flat


def _flat_outputs(out) -> list:
    if isinstance(out, torch.Tensor):
        return [("0", out)]
    if isinstance(out, (list, tuple)):
        return [(str(j), o) for j, o in enumerate(out) if isinstance(o, torch.Tensor)]
    return []


def _called_by_samebits() -> bool:
    """True when the nearest Python caller outside torch is samebits' own code (zero-code
    recording's state census, a recorder): its tensor work is never the program's."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_TORCH_DIR) or filename.startswith(_TRACE_DIR) or filename.startswith("<"):
            frame = frame.f_back  # torch, or the tracer's own wrappers (torch.autograd.backward)
            continue
        return filename.startswith(_LIBRARY_DIR) and not filename.startswith(_CLIENT_DIR)
    return False


class OpMode(TorchDispatchMode):
    """The tracer's dispatch mode; pushed only for the steps rung 3 (or a test hook) needs."""

    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer
        self._info: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        t = self.tracer
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _OpInfo(func)
        if t.busy or not t.open or info.kind == SKIP or _called_by_samebits():
            return func(*args, **kwargs)
        phase = t.current_phase()
        if phase == "backward":
            node = _current_node()
            entry = t.seq_scope.get(node._sequence_nr()) if node is not None else None
            scope, site = entry if entry is not None else ("", None)
        else:
            scope, site = t.scope, None
        name = info.name
        key = (phase, scope, name)
        n = t.op_counts.get(key, 0)
        t.op_counts[key] = n + 1
        g = t.global_op_counts.get(name, 0)
        t.global_op_counts[name] = g + 1
        event_id = f"{scope}/{name}:{n}"
        recorded = t.level_now >= 3 and (not t.config.module or t.config.in_subtree(scope))
        perturb = dump = False
        if t.special:
            perturb, dump = t.special_for(event_id, phase, f"{name}:{g}")
        if phase != "backward":
            if recorded and t.config.call_sites:
                site = call_site(2)
                t.call_sites[f"{phase}|{event_id}"] = site
            seq = _get_sequence_nr()
            if seq:  # the autograd node this op created (if any) has number seq - 1
                t.seq_scope.setdefault(seq - 1, (scope, site))
        elif recorded and site is not None:
            t.call_sites[f"{phase}|{event_id}"] = site

        if info.kind != NORMAL or not (recorded or perturb or dump):
            out = func(*args, **kwargs)
            if recorded and info.kind == NOISE:
                for _, o in _flat_outputs(out):
                    t.mark_seen(o)
            elif recorded and info.kind == VIEW:
                if all(t.is_seen(x) for _, x in _flat_inputs(args, kwargs)):
                    for _, o in _flat_outputs(out):
                        t.mark_seen(o)
            return out

        inputs = _flat_inputs(args, kwargs)
        category_phase = phase
        if info.writes and recorded:  # the op may overwrite an input: digest inputs first
            pre = [(record_name(event_id, "in", label), x) for label, x in inputs
                   if digestable(x) and not t.is_seen(x)]
            if pre:
                t.record_named("op", category_phase, pre)
                for _, x in pre:
                    t.mark_seen(x)
        versions = [version_of(x) for _, x in inputs] if info.writes else None
        dump_inputs = t.copies(inputs) if dump else None  # before the op: it may write into them

        out = func(*args, **kwargs)

        outputs = _flat_outputs(out)
        if info.writes:  # arguments written in place are outputs too
            returned = {id(o) for _, o in outputs}
            for (label, x), before in zip(inputs, versions):
                if id(x) not in returned and version_of(x) != before:
                    outputs.append((f"arg{label}", x))
        if perturb and outputs:
            t.busy = True
            try:
                nudge(outputs[0][1])
            finally:
                t.busy = False
        if recorded:
            named = []
            if not info.writes:
                for label, x in inputs:
                    if digestable(x) and not t.is_seen(x):
                        named.append((record_name(event_id, "in", label), x))
            named += [(record_name(event_id, "out", label), o) for label, o in outputs]
            t.record_named("op", category_phase, named)
            for _, x in inputs:
                t.mark_seen(x)
            for _, o in outputs:
                t.mark_seen(o)
        if dump:
            t.dump(event_id, phase, name, dump_inputs, outputs, site)
        return out
