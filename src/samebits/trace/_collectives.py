"""Rung 1: every `torch.distributed` collective, recorded around the call.

While a tracer exists the functions of ``torch.distributed`` (and ``distributed_c10d``) are
wrapped: inputs are recorded *before* the call, outputs *after it completes* (at return, or at
``wait()`` for ``async_op=True``).  A collective imported by name before tracing, or issued
from C++ (DDP's reducer), is not seen; a checkpoint library's are passed through
(`_checkpointing`).  Ids: ``<group>/<collective>:<n>``, the same on every rank of the group.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
import torch.distributed as dist

from samebits._torchutil import call_site
from samebits.trace._checkpointing import issued_by_checkpointing
from samebits.trace._config import PRE_PHASE
from samebits.trace._tensors import TRACE_DIR


def _single(name):
    return lambda a: [("0", a[name])] if isinstance(a.get(name), torch.Tensor) else []


def _listed(name):
    return lambda a: [(str(i), t) for i, t in enumerate(a.get(name) or ()) if isinstance(t, torch.Tensor)]


# collective -> (inputs from bound arguments, outputs from bound arguments)
_SPECS = {
    "all_reduce": (_single("tensor"), _single("tensor")),
    "broadcast": (_single("tensor"), _single("tensor")),
    "reduce": (_single("tensor"), _single("tensor")),
    "all_gather": (_single("tensor"), _listed("tensor_list")),
    "all_gather_into_tensor": (_single("input_tensor"), _single("output_tensor")),
    "reduce_scatter": (_listed("input_list"), _single("output")),
    "reduce_scatter_tensor": (_single("input"), _single("output")),
    "all_to_all": (_listed("input_tensor_list"), _listed("output_tensor_list")),
    "all_to_all_single": (_single("input"), _single("output")),
}
_originals: dict = {}
_active_tracer: list[Callable] = []  # the tracer registry's `active`, given by `patch`


def group_name(group) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return "group" + "-".join(map(str, dist.get_process_group_ranks(group)))
    except Exception:
        return f"group{id(group):x}"


class _TracedWork:
    """An async collective's Work: records the outputs when the caller waits."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self, *args, **kwargs):
        result = self._work.wait(*args, **kwargs)
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap(name, original):
    signature = inspect.signature(original)
    get_inputs, get_outputs = _SPECS[name]

    @functools.wraps(original)
    def traced(*args, **kwargs):
        tracer = _active_tracer[0]() if _active_tracer else None
        if tracer is None or tracer.busy or not dist.is_initialized():
            return original(*args, **kwargs)
        if not tracer.armed:
            tracer.arm()  # zero-code: a process issuing collectives is a worker
        state = tracer.now
        # (a checkpoint save's coordination, with its random save_id, is not training)
        if state is None or (state.level < 1 and not state.special) or issued_by_checkpointing():
            return original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        arguments = dict(bound.arguments)
        phase = tracer.current_phase()
        group = group_name(arguments.get("group"))
        # Collectives count per group in a step (every rank names a collective alike), those of
        # the step's "pre" work apart: a resumed process's start-up shifts no later id.
        n = state.next_number("collective", (group, name) if phase != PRE_PHASE else (PRE_PHASE, group, name))
        event_id = f"{group}/{name}:{n}"
        perturb, dump = tracer.special_for(event_id, phase) if state.special else (False, False)
        inputs = get_inputs(arguments)
        if state.level >= 1:
            tracer.record("collective", event_id, "in", inputs, phase)
            if tracer.config.call_sites:
                state.note_call_site(phase, event_id, call_site(2, skip=(TRACE_DIR, "<")))
        dump_inputs = tracer.copies(inputs) if dump else None
        step = tracer.step_now

        def finish():
            if tracer.now is None or tracer.step_now != step:
                return
            outputs = get_outputs(arguments)
            if perturb and outputs:
                tracer.nudge(outputs[0][1])
            if state.level >= 1:
                tracer.record("collective", event_id, "out", outputs, phase)
            if dump:
                tracer.dump(event_id, phase, name, dump_inputs, outputs, None)

        with tracer.suspended():  # the wrapper's own tensor work is not the program's
            result = original(*args, **kwargs)
        if arguments.get("async_op") and result is not None:
            return _TracedWork(result, finish)
        finish()
        return result

    traced._samebits_original = original
    return traced


def patch(active: Callable) -> None:
    """Wrap torch.distributed's collectives (idempotent); ``active()`` gives the tracer in force."""
    _active_tracer[:] = [active]
    if _originals or not dist.is_available():
        return
    from torch.distributed import distributed_c10d

    for name in _SPECS:
        original = getattr(dist, name, None)
        if original is None:
            continue
        _originals[name] = original
        traced = _wrap(name, original)
        setattr(dist, name, traced)
        if getattr(distributed_c10d, name, None) is original:
            setattr(distributed_c10d, name, traced)


def unpatch() -> None:
    if not _originals:
        return
    from torch.distributed import distributed_c10d

    for name, original in _originals.items():
        if getattr(dist, name, None) is not original:
            setattr(dist, name, original)
        if getattr(getattr(distributed_c10d, name, None), "_samebits_original", None) is original:
            setattr(distributed_c10d, name, original)
    _originals.clear()
