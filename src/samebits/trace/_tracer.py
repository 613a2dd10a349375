"""`Tracer`: the per-process state behind every tracing rung, and its step lifecycle.

One tracer per process (`active()`), writing into the run's Recorder, so traced records sit in
the rank's stream in execution order.  A selected step's hooks (its `StepState`) are installed by
`begin_step` and removed by `finish_step`, just before the recorder writes the step; outside one
only the rung-1 patches stay, at one attribute check each.  samebits' own torch work inside a
traced step runs in `Tracer.suspended()`, unseen by the dispatch mode.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode

from samebits._torchutil import call_site, optimizer_params, process_rank, tensor_leaves
from samebits.checkpoint import state_census
from samebits.stream.optimizer_state import state_tensors
from samebits.trace import _checkpointing, _collectives
from samebits.trace._config import (CENSUS_EVENT, CENSUS_PHASE, PRE_PHASE, TraceConfig, record_name, record_phase,
                                    source_prefix)
from samebits.trace._ops import OpMode
from samebits.trace._step import Frame, StepState
from samebits.trace._tensors import TRACE_DIR, digestable, nudge

_active: "Tracer | None" = None


def active() -> "Tracer | None":
    """The tracer installed in this process, if any."""
    return _active


def _set_active(tracer: "Tracer | None") -> None:
    global _active
    _active = tracer


def _labelled(value) -> list:
    """(label, tensor) of a module's inputs or outputs; a bare tensor is labelled ``0``."""
    return [(label or "0", t) for label, t in tensor_leaves(value)]


class _Suspension:
    """`Tracer.suspended()`: a cheap re-entrant context manager (it wraps every Recorder call)."""

    __slots__ = ("_tracer", "_was_busy")

    def __init__(self, tracer: "Tracer"):
        self._tracer = tracer

    def __enter__(self) -> None:
        self._was_busy, self._tracer.busy = self._tracer.busy, True

    def __exit__(self, *exc) -> None:
        self._tracer.busy = self._was_busy


class Tracer:
    """Tracing state of this process, built by `samebits.trace.attach` or zero-code recording."""

    def __init__(self, config: TraceConfig, *, recorder=None, recorder_source: Callable | None = None,
                 rank: int | None = None, zero_code: bool = False):
        self.config = config
        self._recorder = None
        self._recorder_source = recorder_source
        self._recorder_hooks: list = []
        self.zero_code = zero_code
        # Zero-code: the rank is known once the worker has joined its group (at arming).
        self.rank = rank if rank is not None else (None if zero_code else _rank_of(recorder))
        self.step_now: int | None = None
        self.now: StepState | None = None  # the open step (records are accepted), or None
        self.armed = not zero_code  # zero-code: nothing is recorded before the first module forward
        self.busy = False  # True inside suspended(): samebits' own torch work, never traced
        self.fqns: dict[int, str] = {}
        self.param_names: dict[int, str] = {}
        self.roots: list[torch.nn.Module] = []
        self._root_ids: set[int] = set()
        self._state_recorded = False
        # Optimizers (weak references) from their construction (zero-code) or first step: their
        # step counts and lrs go in the census, so that a resumed process's first census has them.
        self._optimizers: list = []
        self._optimizer_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> where it was built
        self._census_warned = False
        self._census_step: int | None = None  # the step whose census is recorded
        self._grad_hooks: list = []
        self._step_handles: list = []
        self._permanent_handles: list = []
        self._arm_handle = None
        self._mode = None
        self._mode_pushed = self._mode_stuck = False
        self._call_site_file_steps: dict[str, dict] = {}
        self._closed = False
        if recorder is not None:
            self._adopt(recorder)

    @property
    def level_now(self) -> int:
        """The rung in force for the open step (0 when none is open)."""
        return self.now.level if self.now is not None else 0

    def suspended(self) -> _Suspension:
        """``with tracer.suspended():`` samebits' own torch work inside is never traced or counted."""
        return _Suspension(self)

    # -- recorder ---------------------------------------------------------------------------

    def recorder(self):
        rec = self._recorder
        if rec is None and self._recorder_source is not None:
            rec = self._recorder_source()
            if rec is not None:
                self._adopt(rec)
        return rec

    def _adopt(self, rec) -> None:
        """Write into ``rec``: its own tensor work runs suspended, and (explicit loops) its
        ``end_step`` finishes our step first, through the Recorder's hooks."""
        self._recorder = rec
        if hasattr(rec, "around_own_work"):
            self._recorder_hooks.append(rec.around_own_work(self.suspended))
        if not self.zero_code and hasattr(rec, "on_end_step"):  # zero-code recording drives the steps itself
            self._recorder_hooks.append(rec.on_end_step(before=self._before_end_step, after=self._after_end_step))

    def _before_end_step(self, step: int | None) -> None:
        self.finish_step(self.step_now if step is None else step)

    def _after_end_step(self, step: int | None) -> None:
        self.after_end_step(self.step_now if step is None else step)

    def record(self, category: str, event_id: str, role: str, pairs, phase: str | None = None) -> None:
        """Record (label, tensor) pairs of one event as one Recorder call."""
        self.record_named(category, phase or self.current_phase(),
                          [(record_name(event_id, role, label), t) for label, t in pairs])

    def record_named(self, category: str, phase: str, named) -> None:
        """Record (record name, tensor) pairs under ``trace:<category>:<phase>``."""
        if self.step_now is None:
            return
        was_busy, self.busy = self.busy, True  # detach() and digests are our ops, not the program's
        try:
            named = [(name, t if t is None else t.detach()) for name, t in named if t is None or digestable(t)]
            rec = self.recorder() if named else None
            if rec is not None:
                rec.tensors(self.step_now, record_phase(category, phase), named)
        finally:
            self.busy = was_busy

    def copies(self, pairs) -> list:
        """CPU copies of (label, tensor) pairs, for a dump (never traced)."""
        with self.suspended():
            return [(label, t.detach().to("cpu", copy=True)) for label, t in pairs if isinstance(t, torch.Tensor)]

    def nudge(self, t: torch.Tensor) -> None:
        """The test hook: move ``t``'s first element by one ulp, in place (never traced)."""
        with self.suspended(), torch.no_grad():
            nudge(t)

    # -- step lifecycle ---------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start `step`: fresh per-step state; install its hooks if it is traced."""
        if self.now is not None:
            self.finish_step(self.step_now)
        self.step_now = step
        if self.armed:
            self._activate()

    def _activate(self) -> None:
        """Open the step: what it traces on this rank (rung, test/dump hooks), and its hooks."""
        cfg, step = self.config, self.step_now
        _checkpointing.patch(active)  # DCP imported since the last step: its save and load run untraced
        selected = cfg.rank_selected(self.rank) and cfg.step_selected(step)
        level = cfg.level if selected else 0
        special = [s for s in (cfg.perturb, cfg.dump) if s is not None and s.step == step and s.rank == self.rank]
        ops_needed = level >= 3 or any(_names_an_op(s.id) for s in special)
        self.now = StepState(step, level, special, ops_needed)
        if level >= 1 or ops_needed:
            self._step_handles.append(register_module_forward_pre_hook(self._pre_forward))
            self._step_handles.append(register_module_forward_hook(self._post_forward, always_call=True,
                                                                   with_kwargs=True))
        if ops_needed and not self._mode_pushed:
            if self._mode is None:
                self._mode = OpMode(self)
            self._mode.__enter__()
            self._mode_pushed = True

    @contextlib.contextmanager
    def step(self, step: int):
        """Trace one training step: ``with tracer.step(step): train_step()``.  The step ends
        when the recorder's ``end_step`` runs inside the block, or at the block's end."""
        self.begin_step(step)
        try:
            yield self
        finally:
            if self.now is not None and self.step_now == step:
                self.finish_step(step)

    def arm(self) -> None:
        """Zero-code: the first module forward (or collective) of a worker starts recording."""
        if not self.armed:
            self.armed = True
            if self.rank is None:
                self.rank = _rank_of(None)
            if self.step_now is not None:
                self._activate()

    def finish_step(self, step: int | None) -> None:
        """Remove the step's hooks and mode; called just before the recorder writes `step`."""
        state = self.now
        if state is None:
            return
        self.now = None
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        if self._mode_pushed:
            if _get_current_dispatch_mode() is self._mode:
                self._mode.__exit__(None, None, None)
                self._mode_pushed = False
            elif not self._mode_stuck:  # a mode pushed above ours: ours stays, passing ops through
                self._mode_stuck = True
                warnings.warn("samebits.trace: another dispatch mode sits above the tracer's, so the tracer's "
                              "stays installed; outside traced steps it passes every op through", stacklevel=2)
        if state.call_sites:
            self._write_call_sites(step, state.call_sites)

    def after_end_step(self, step: int | None) -> None:
        if self.config.stop_after is not None and step == self.config.stop_after:
            rec = self.recorder()
            if rec is not None and hasattr(rec, "close"):
                rec.close()
            raise SystemExit(0)  # bisect re-runs need nothing after this step

    def close(self) -> None:
        """Remove every hook and patch this tracer installed.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.finish_step(self.step_now)
        for handles in (self._permanent_handles, self._grad_hooks, self._recorder_hooks):
            for handle in handles:
                handle.remove()
            handles.clear()
        _collectives.unpatch()
        _checkpointing.unpatch()
        _unpatch_autograd()
        _unpatch_optimizer_init()
        if _active is self:
            _set_active(None)

    # -- phases ---------------------------------------------------------------------------

    def current_phase(self) -> str:
        state = self.now
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if state is not None and state.recomputing() else "backward"
        return state.stage if state is not None else "forward"

    def install_permanent(self) -> None:
        """Rung-1 patches and optimizer hooks, for the life of the tracer."""
        _collectives.patch(active)
        _checkpointing.patch(active)
        _patch_autograd()
        self._permanent_handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        if not self.zero_code:  # zero-code recording calls optimizer_post itself, before end_step
            self._permanent_handles.append(register_optimizer_step_post_hook(self.optimizer_post))
        else:
            self._arm_handle = register_module_forward_pre_hook(self._arm_on_forward)
            self._permanent_handles.append(self._arm_handle)
            _patch_optimizer_init()

    def _arm_on_forward(self, module, args) -> None:
        if not self.armed:
            self._arm_handle.remove()  # safe: a running call iterates over a snapshot of the hooks
            self.arm()
            state = self.now
            if state is not None and (state.level >= 1 or state.ops_needed):
                # Hooks added while hooks run take effect from the next call: run ours now.
                self._pre_forward(module, args)

    def add_root(self, module: torch.nn.Module, prefix: str = "") -> None:
        """Name a model's modules and parameters by FQN (prefix + name)."""
        if id(module) in self._root_ids:
            return
        self._root_ids.add(id(module))
        self.roots.append(module)
        for name, sub in module.named_modules():
            self.fqns.setdefault(id(sub), prefix + name if name else prefix.rstrip("."))
        for name, param in module.named_parameters():
            self.param_names.setdefault(id(param), prefix + name)
            if self.config.level >= 2:
                self._grad_hooks.append(param.register_post_accumulate_grad_hook(
                    self._make_grad_hook(prefix + name)))

    def _named_params(self):
        for root in self.roots:
            for param in root.parameters():
                yield self.param_names.get(id(param), "?"), param

    def _record_census(self) -> None:
        """Rung 1, every traced step: the state census at the step's first top-level forward.
        Context, not an event: never an origin, but it names the generator behind an RNG op."""
        try:
            with self.suspended():
                pairs = state_census(optimizers=self.optimizers())
        except Exception as err:  # the census must never break the traced program
            if not self._census_warned:
                self._census_warned = True
                warnings.warn(f"samebits.trace: the state census failed ({err}); RNG state is not traced",
                              stacklevel=2)
            return
        self.record("census", CENSUS_EVENT, "at", pairs, phase=CENSUS_PHASE)

    def _record_state(self) -> None:
        """Rung 1, first traced step: the parameters before it (initialisation, or a resume)."""
        if self._state_recorded or self.level_now < 1:
            return
        self._state_recorded = True
        self.record("state", "params", "out", list(self._named_params()), phase="init")

    # -- module hooks (rungs 1 and 2; scope for rung 3) ---------------------------------------

    def _pre_forward(self, module, args) -> None:
        state = self.now
        if self.busy or state is None:
            return
        # A module forward inside the autograd engine is a recomputation (activation checkpointing).
        phase = "recompute" if torch._C._current_graph_task_id() != -1 else state.stage
        is_root = not state.frames
        fqn = self.fqns.get(id(module))
        if fqn is None:
            if is_root and self.zero_code:
                self.add_root(module, prefix="" if not self.roots else type(module).__name__ + ".")
                fqn = self.fqns[id(module)]
            elif is_root:
                fqn = type(module).__name__
            else:
                fqn = f"{state.scope}.{type(module).__name__}" if state.scope else type(module).__name__
        if is_root and phase != "recompute":
            if state.stage in (PRE_PHASE, "reduce", "post"):
                state.enter_stage("forward")  # the step's first forward, or a new micro-batch (or evaluation)
            phase = state.stage
            self._record_state()
            if state.level >= 1 and self._census_step != self.step_now:
                self._census_step = self.step_now
                self._record_census()
        count = state.next_number("module", (phase, fqn))
        frame = Frame(fqn, count, phase, state.level >= 2 and self.config.in_subtree(fqn), is_root)
        state.push(frame)
        if is_root and state.level >= 1 and phase == "forward":
            label = fqn or "model"
            frame.forward_n = state.next_number("phase", "forward/" + label)
            pairs = _labelled(args)
            event = f"forward/{label}:{frame.forward_n}"
            self.record("phase", event, "in", pairs, phase)
            state.mark_all_seen(pairs, source_prefix(phase, event, "in"))
        if frame.recorded:
            pairs = state.unseen(_labelled(args))
            self.record("module", f"{fqn}:{count}", "in", pairs, phase)
            state.mark_all_seen(pairs, source_prefix(phase, f"{fqn}:{count}", "in"))

    def _post_forward(self, module, args, kwargs=None, output=None) -> None:
        # (module, args, kwargs, output); when forward raised, torch passes fewer arguments
        state = self.now
        if self.busy or state is None:
            return
        frame = state.pop()
        if frame is None:
            return
        fqn, phase = frame.fqn, frame.phase
        if frame.recorded:
            leaves = _labelled(output)
            pairs = state.unseen(leaves)
            self.record("module", f"{fqn}:{frame.count}", "out", pairs, phase)
            state.mark_all_seen(pairs, source_prefix(phase, f"{fqn}:{frame.count}", "out"))
            if phase == "forward" and torch.is_grad_enabled():
                self._hook_backward(fqn, frame.count, leaves, _labelled(args))
        if frame.is_root and frame.forward_n is not None:
            event = f"forward/{fqn or 'model'}:{frame.forward_n}"
            if isinstance(kwargs, dict) and kwargs:  # keyword inputs (model(**batch)): a global pre-hook sees only positional ones
                self.record("phase", event, "in", _labelled(kwargs), phase)
            self.record("phase", event, "out", _labelled(output), phase)

    def _hook_backward(self, fqn: str, count: int, outputs, inputs) -> None:
        """Tensor hooks: the gradients reaching the module's outputs (the backward event's
        inputs) and its inputs (its outputs).  An input's hook sees its *total* gradient."""
        step, event = self.step_now, f"{fqn}:{count}"
        for role, pairs, tag in (("in", outputs, "grad_out"), ("out", inputs, "grad_in")):
            for label, t in pairs:
                if not t.requires_grad:
                    continue

                def hook(grad, _role=role, _label=f"{tag}{label}"):
                    if self.now is not None and self.step_now == step:
                        self.record("module", event, _role, [(_label, grad)], "backward")

                t.register_hook(hook)

    def _make_grad_hook(self, name: str):
        owner = name.rpartition(".")[0]

        def hook(param):
            if self.level_now >= 2 and self.config.in_subtree(owner):
                self.record("module", f"{name}@grad", "out", [("grad", param.grad)], "backward")

        return hook

    # -- optimizer and autograd (rung 1) -------------------------------------------------------

    def optimizers(self) -> tuple:
        """The optimizers seen so far (built, or stepped), in that order, those still alive."""
        return tuple(o for o in (ref() for ref in self._optimizers) if o is not None)

    def note_optimizer(self, optimizer, site: str | None = None) -> None:
        """An optimizer was built (zero-code: at its construction, at ``site``) or stepped."""
        if not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
        if site is not None:
            try:
                self._optimizer_sites.setdefault(optimizer, site)
            except TypeError:  # not weakly referenceable
                pass

    def _optimizer_pre(self, optimizer, args, kwargs):
        self.note_optimizer(optimizer)
        state = self.now
        if state is None:
            return None
        # torch hands a global pre-hook the step's args with the optimizer first: step(self, closure)
        closure = kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        if callable(closure):
            # ``step(closure)`` (Lightning, LBFGS): the closure runs the step's forward and backward
            # inside step(), so the optimizer phase begins when the closure returns.
            def traced_closure(*closure_args, **closure_kwargs):
                if self.now is state and state.stage == "optimizer":
                    state.enter_stage("post")  # a root forward inside the closure begins a new forward
                result = closure(*closure_args, **closure_kwargs)
                if self.now is state:
                    self._enter_optimizer(optimizer, state)
                return result

            if "closure" in kwargs:
                return args, {**kwargs, "closure": traced_closure}
            return (args[0], traced_closure, *args[2:]), kwargs
        self._enter_optimizer(optimizer, state)
        return None

    def _enter_optimizer(self, optimizer, state) -> None:
        """The reduced gradients the update starts from, then the optimizer phase."""
        if state.level >= 1:
            n = state.peek_number("phase", "optimizer")
            self.record("phase", f"reduce:{n}", "out",
                        [(name, p.grad) for name, p in optimizer_params(optimizer, self.param_names)], "reduce")
            if self.config.call_sites:  # where the optimizer was built (its parameter order), else its step() call
                site = self._optimizer_sites.get(optimizer) or call_site(2, skip=(TRACE_DIR, "<"))
                state.note_call_site("reduce", f"reduce:{n}", site)
                state.note_call_site("optimizer", f"optimizer:{n}", site)
        state.enter_stage("optimizer")

    def optimizer_post(self, optimizer, args=None, kwargs=None) -> None:
        state = self.now
        if state is None:
            return
        if state.level >= 1:
            n = state.next_number("phase", "optimizer")
            pairs = []
            for name, param in optimizer_params(optimizer, self.param_names):
                pairs += [(name, param), *state_tensors(optimizer, name, param)]
            self.record("phase", f"optimizer:{n}", "out", pairs, "optimizer")
        state.enter_stage("post")

    def before_backward(self, kind: str, roots, grads) -> int | None:
        state = self.now
        if state is None:
            return None
        state.enter_stage("backward")
        if state.level < 1:
            return None
        n = state.next_number("phase", kind)
        pairs = [(f"root{i}", t) for i, t in enumerate(roots) if isinstance(t, torch.Tensor)]
        pairs += [(f"grad{i}", t) for i, t in enumerate(grads or ()) if isinstance(t, torch.Tensor)]
        self.record("phase", f"{kind}:{n}", "in", pairs, "backward")
        return n

    def after_backward(self, kind: str, n: int | None, results=None) -> None:
        state = self.now
        if state is None:
            return
        state.enter_stage("reduce")
        if n is None:
            return
        if kind == "backward":
            pairs = [(name, p.grad) for name, p in self._named_params() if p.grad is not None]
        else:
            pairs = [(str(i), t) for i, t in enumerate(results or ()) if isinstance(t, torch.Tensor)]
        self.record("phase", f"{kind}:{n}", "out", pairs, "backward")

    # -- perturbation and dumps (shared by ops, collectives, probes) ---------------------------

    def special_for(self, event_id: str, phase: str, global_id: str | None = None):
        """(perturb?, dump?) for this event on this rank and step."""
        perturb = dump = False
        for spec in self.now.special if self.now is not None else ():
            wanted = spec.id == event_id or (global_id is not None and spec.id == global_id)
            if wanted and (spec.phase is None or spec.phase == phase):
                if spec is self.config.perturb:
                    perturb = True
                if spec is self.config.dump:
                    dump = True
        return perturb, dump

    def dump(self, event_id: str, phase: str, op: str, inputs, outputs, site: str | None) -> None:
        directory = self._side_dir()
        if directory is None:
            warnings.warn("samebits.trace: no directory for the dump; set SAMEBITS_TRACE_DUMP_DIR", stacklevel=2)
            return
        with self.suspended():
            payload = {
                "step": self.step_now, "rank": self.rank, "id": event_id, "phase": phase, "op": op,
                "call_site": site,
                "inputs": dict(self.copies(inputs)),
                "outputs": dict(self.copies(outputs)),
            }
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(payload, directory / dump_filename(self.rank, self.step_now))

    def _side_dir(self) -> Path | None:
        if self.config.dump_dir is not None:
            return Path(self.config.dump_dir)
        rec = self.recorder()
        settings = getattr(rec, "settings", None)
        return getattr(settings, "directory", None)

    def _write_call_sites(self, step, call_sites: dict) -> None:
        directory = self._side_dir()
        if directory is None:
            return
        self._call_site_file_steps[str(step)] = dict(call_sites)
        path = directory / call_sites_filename(self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": self.rank, "steps": self._call_site_file_steps}, indent=1))


def dump_filename(rank: int, step: int) -> str:
    return f"dump-rank-{rank:05d}-step-{step}.pt"


def call_sites_filename(rank: int) -> str:
    return f"trace-rank-{rank:05d}.json"


def _names_an_op(event_id: str) -> bool:
    """ATen op ids (``aten::mm:3``, ``scope/aten::mm:0``) need the dispatch mode."""
    return "::" in event_id.rpartition("/")[2]


def _rank_of(recorder) -> int:
    rank = getattr(recorder, "rank", None)
    if rank is not None:
        return int(rank)
    found = process_rank()
    return 0 if found is None else found


# -- torch.autograd.backward / grad -------------------------------------------------------------

_autograd_originals: dict[str, Any] = {}  # name -> what our wrapper calls
_autograd_patches: dict[str, Any] = {}  # name -> our wrapper, while it is in the chain


def _patch_autograd() -> None:
    """Wrap torch.autograd.backward and grad, each unless our wrapper is still in the chain
    (in place, or left under another wrapper by `_unpatch_autograd`)."""
    original_backward = _autograd_originals.get("backward", torch.autograd.backward)
    original_grad = _autograd_originals.get("grad", torch.autograd.grad)

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        tracer = _active
        if tracer is None or tracer.now is None or tracer.busy:
            return original_backward(tensors, grad_tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors or ())
        n = tracer.before_backward("backward", roots, grads)
        result = original_backward(tensors, grad_tensors, *args, **kwargs)
        tracer.after_backward("backward", n)
        return result

    def grad(outputs, inputs, *args, **kwargs):
        tracer = _active
        if tracer is None or tracer.now is None or tracer.busy:
            return original_grad(outputs, inputs, *args, **kwargs)
        roots = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        n = tracer.before_backward("grad", roots, None)
        result = original_grad(outputs, inputs, *args, **kwargs)
        tracer.after_backward("grad", n, result)
        return result

    for name, original, wrapper in (("backward", original_backward, backward), ("grad", original_grad, grad)):
        if name not in _autograd_originals:
            _autograd_originals[name] = original
            _autograd_patches[name] = wrapper
            setattr(torch.autograd, name, wrapper)


def _unpatch_autograd() -> None:
    """Put back each function this module replaced, if it is still the one there.  One wrapped
    since (zero-code recording's backward-root wrapper) stays, passing straight through, and is
    reused if tracing starts anew."""
    for name in ("backward", "grad"):
        if name in _autograd_patches and getattr(torch.autograd, name) is _autograd_patches[name]:
            setattr(torch.autograd, name, _autograd_originals.pop(name))
            del _autograd_patches[name]


# -- torch.optim.Optimizer.__init__ (zero-code arming) --------------------------------------------

_optimizer_init: list = []
# Frames that are not the user's when an optimizer is built: the tracer's, and zero-code
# recording's constructor wrappers (a sibling folder; trace imports nothing above it).
_OWN_DIRS = (TRACE_DIR, os.path.join(os.path.dirname(TRACE_DIR), "autorecord") + os.sep, "<")


def _patch_optimizer_init() -> None:
    """Zero-code: a process that builds an optimizer is a training worker, traced from there;
    launchers and data-loader workers build none and stay unarmed."""
    if _optimizer_init:
        return
    original = torch.optim.Optimizer.__init__
    _optimizer_init.append(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        tracer = _active
        if tracer is not None and not tracer.busy:
            tracer.note_optimizer(self, call_site(2, skip=_OWN_DIRS))
            if not tracer.armed:
                tracer.arm()

    torch.optim.Optimizer.__init__ = __init__


def _unpatch_optimizer_init() -> None:
    if _optimizer_init:
        torch.optim.Optimizer.__init__ = _optimizer_init.pop()
