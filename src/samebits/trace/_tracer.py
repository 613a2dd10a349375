"""`Tracer`: the per-process state behind every tracing rung, and its step lifecycle.

One tracer per process (`active()`); it writes into the run's ordinary Recorder, so traced
records sit in the same per-rank stream as the step's own records, in execution order.

Lifecycle of a step: `begin_step(step)` resets the per-step counters and, when the step,
rank and rung select it, installs that step's hooks (global module hooks, the ATen dispatch
mode); `finish_step(step)` removes them just before the recorder writes the step (the
tracer wraps the recorder's ``end_step`` for that); `after_end_step(step)` ends the process
when ``stop_after`` says so.  Outside a selected step nothing is installed but the rung-1
patches (collectives, ``torch.autograd.backward``, optimizer hooks), which return after one
attribute check.
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

from samebits.checkpoint import state_census
from samebits.trace import _collectives
from samebits.trace._config import CENSUS_EVENT, CENSUS_PHASE, TraceConfig, record_name, record_phase
from samebits.trace._ops import OpMode
from samebits.trace._tensors import digestable, tensor_leaves, version_of

_active: "Tracer | None" = None


def active() -> "Tracer | None":
    """The tracer installed in this process, if any."""
    return _active


def _set_active(tracer: "Tracer | None") -> None:
    global _active
    _active = tracer


class Tracer:
    """Tracing state of this process.  Build it with `samebits.trace.attach` (explicit
    training loops) or let zero-code recording build it; do not construct it directly."""

    def __init__(self, config: TraceConfig, *, recorder=None, recorder_source: Callable | None = None,
                 rank: int | None = None, zero_code: bool = False):
        self.config = config
        self._recorder = recorder
        self._recorder_source = recorder_source
        self.zero_code = zero_code
        # Zero-code: the rank is known once the worker has joined its group (at arming).
        self.rank = rank if rank is not None else (None if zero_code else _rank_of(recorder))
        self.step_now: int | None = None
        self.open = False  # records are accepted (an open step on this rank)
        self.armed = not zero_code  # zero-code: nothing is recorded before the first module forward
        self.level_now = 0  # rung in force for the open step
        self.ops_needed = False
        self.special: list = []  # perturb / dump specs naming this rank and step
        self.busy = False  # set while the tracer itself runs torch ops (never trace those)
        self.stage = "forward"
        self.frames: list[tuple] = []  # module stack: (fqn, count, phase, recorded, is_root)
        self.scope = ""
        self.fqns: dict[int, str] = {}
        self.param_names: dict[int, str] = {}
        self.roots: list[torch.nn.Module] = []
        self._root_ids: set[int] = set()
        self._state_recorded = False
        self._optimizers: list = []  # seen at their first step: their step counts and lrs go in the census
        self._census_warned = False
        self._census_step: int | None = None  # the step whose census is recorded
        self._grad_hooks: list = []
        self._step_handles: list = []
        self._permanent_handles: list = []
        self._mode = None
        self._mode_pushed = self._mode_stuck = False
        self._reset_counters()
        self._call_site_file_steps: dict[str, dict] = {}
        self._closed = False

    # -- recorder ---------------------------------------------------------------------------

    def recorder(self):
        rec = self._recorder
        if rec is None and self._recorder_source is not None:
            rec = self._recorder_source()
            self._recorder = rec
        if rec is not None and not getattr(rec, "_samebits_trace_guarded", False):
            self._guard_recorder(rec)
        return rec

    def _guard_recorder(self, rec) -> None:
        """The recorder's own torch ops (byte views, copies) must never be traced as user ops."""
        for name in ("tensors", "metrics"):
            method = getattr(rec, name)

            def guarded(*args, _method=method, **kwargs):
                if self.busy:
                    return _method(*args, **kwargs)
                self.busy = True
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.busy = False

            setattr(rec, name, guarded)
        if not self.zero_code:  # explicit loops: finish our step when the recorder writes it
            end_step = rec.end_step

            def wrapped_end_step(step=None, _end_step=end_step):
                closing = self.step_now if step is None else step
                self.finish_step(closing)
                result = _end_step(step)
                self.after_end_step(closing)
                return result

            rec.end_step = wrapped_end_step
        rec._samebits_trace_guarded = True

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
        was_busy, self.busy = self.busy, True
        try:
            return [(label, t.detach().to("cpu", copy=True)) for label, t in pairs if isinstance(t, torch.Tensor)]
        finally:
            self.busy = was_busy

    # -- step lifecycle ---------------------------------------------------------------------

    def _reset_counters(self) -> None:
        self.module_counts: dict[tuple, int] = {}
        self.op_counts: dict[tuple, int] = {}
        self.global_op_counts: dict[str, int] = {}
        self.collective_counts: dict[tuple, int] = {}
        self.phase_counts: dict[str, int] = {}
        self.probe_counts: dict[tuple, int] = {}
        self.seen: dict[int, tuple] = {}
        self.seq_scope: dict[int, tuple] = {}
        self.call_sites: dict[str, str] = {}

    def begin_step(self, step: int) -> None:
        """Start `step`: reset per-step ids; install its hooks if it is traced."""
        if self.open:
            self.finish_step(self.step_now)
        self.step_now = step
        self._reset_counters()
        self.stage = "forward"
        self.frames.clear()
        self.scope = ""
        if self.armed:
            self._select()
            self._activate()

    def _select(self) -> None:
        """What the open step traces on this rank: rung, and test/dump hooks."""
        cfg, step = self.config, self.step_now
        selected = cfg.rank_selected(self.rank) and cfg.step_selected(step)
        self.level_now = cfg.level if selected else 0
        self.special = [s for s in (cfg.perturb, cfg.dump)
                        if s is not None and s.step == step and s.rank == self.rank]
        self.ops_needed = self.level_now >= 3 or any(_names_an_op(s.id) for s in self.special)

    def _activate(self) -> None:
        self.open = True
        if self.level_now >= 1 or self.ops_needed:
            from torch.nn.modules.module import (register_module_forward_hook,
                                                 register_module_forward_pre_hook)

            self._step_handles.append(register_module_forward_pre_hook(self._pre_forward))
            self._step_handles.append(register_module_forward_hook(self._post_forward, always_call=True,
                                                                   with_kwargs=True))
        if self.ops_needed and not self._mode_pushed:
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
            if self.open and self.step_now == step:
                self.finish_step(step)

    def arm(self) -> None:
        """Zero-code: the first module forward (or collective) of a worker starts recording."""
        if not self.armed:
            self.armed = True
            if self.rank is None:
                self.rank = _rank_of(None)
            if self.step_now is not None:
                self._select()
                self._activate()

    def finish_step(self, step: int | None) -> None:
        """Remove the step's hooks and mode; called just before the recorder writes `step`."""
        if not self.open:
            return
        self.open = False
        for handle in self._step_handles:
            handle.remove()
        self._step_handles.clear()
        if self._mode_pushed:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is self._mode:
                self._mode.__exit__(None, None, None)
                self._mode_pushed = False
            elif not self._mode_stuck:  # a mode pushed above ours: ours stays, passing ops through
                self._mode_stuck = True
                warnings.warn("samebits.trace: another dispatch mode sits above the tracer's, so the tracer's "
                              "stays installed; outside traced steps it passes every op through", stacklevel=2)
        if self.call_sites:
            self._write_call_sites(step)
        self.frames.clear()
        self.scope = ""

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
        for handle in self._permanent_handles + self._grad_hooks:
            handle.remove()
        self._permanent_handles.clear()
        self._grad_hooks.clear()
        _collectives.unpatch()
        _unpatch_autograd()
        _unpatch_optimizer_init()
        if _active is self:
            _set_active(None)

    # -- phases ---------------------------------------------------------------------------

    def current_phase(self) -> str:
        if torch._C._current_graph_task_id() != -1:
            return "recompute" if any(f[2] == "recompute" for f in self.frames) else "backward"
        return self.stage

    def install_permanent(self) -> None:
        """Rung-1 patches and optimizer hooks, for the life of the tracer."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _collectives.patch(active)
        _patch_autograd()
        self._permanent_handles.append(register_optimizer_step_pre_hook(self._optimizer_pre))
        if not self.zero_code:  # zero-code recording calls optimizer_post itself, before end_step
            self._permanent_handles.append(register_optimizer_step_post_hook(self.optimizer_post))
        if self.zero_code:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._arm_handle = register_module_forward_pre_hook(self._arm_on_forward)
            self._permanent_handles.append(self._arm_handle)
            _patch_optimizer_init()

    def _arm_on_forward(self, module, args) -> None:
        if not self.armed:
            self._arm_handle.remove()  # safe: a running call iterates over a snapshot of the hooks
            self.arm()
            if self.open and (self.level_now >= 1 or self.ops_needed):
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

    def _next(self, counts: dict, key) -> int:
        n = counts.get(key, 0)
        counts[key] = n + 1
        return n

    def _record_census(self) -> None:
        """Rung 1, every traced step: the state census (every RNG state, optimizer step counts
        and learning rates) at the step's first top-level forward, the state the model's RNG ops
        start from.  Context, not an event: `find_origins`
        never calls it an origin, but names the generator that differs when an RNG op is one."""
        was_busy, self.busy = self.busy, True
        try:
            pairs = state_census(optimizers=tuple(self._optimizers))
        except Exception as err:  # the census must never break the traced program
            if not self._census_warned:
                self._census_warned = True
                warnings.warn(f"samebits.trace: the state census failed ({err}); RNG state is not traced",
                              stacklevel=2)
            return
        finally:
            self.busy = was_busy
        self.record("census", CENSUS_EVENT, "at", pairs, phase=CENSUS_PHASE)

    def _record_state(self) -> None:
        """Rung 1, first traced step: the parameters before it (initialisation, or a resume)."""
        if self._state_recorded or self.level_now < 1:
            return
        self._state_recorded = True
        self.record("state", "params", "out", list(self._named_params()), phase="init")

    # -- seen tensors (each tensor version is recorded once per step) ------------------------

    def is_seen(self, t: torch.Tensor) -> bool:
        entry = self.seen.get(id(t))
        if entry is not None and entry[1]() is t:
            return entry[0] is not None and entry[0] == version_of(t)
        base = t._base  # a view of a recorded base holds recorded bytes
        return base is not None and self.is_seen(base)

    def mark_seen(self, t: torch.Tensor) -> None:
        version = version_of(t)
        if version is not None:
            self.seen[id(t)] = (version, weakref.ref(t))

    # -- module hooks (rungs 1 and 2; scope for rung 3) ---------------------------------------

    def _pre_forward(self, module, args) -> None:
        if self.busy or not self.open:
            return
        # A module forward inside the autograd engine is a recomputation (activation checkpointing).
        phase = "recompute" if torch._C._current_graph_task_id() != -1 else self.stage
        is_root = not self.frames
        fqn = self.fqns.get(id(module))
        if fqn is None:
            if is_root and self.zero_code:
                self.add_root(module, prefix="" if not self.roots else type(module).__name__ + ".")
                fqn = self.fqns[id(module)]
            elif is_root:
                fqn = type(module).__name__
            else:
                fqn = f"{self.scope}.{type(module).__name__}" if self.scope else type(module).__name__
        if is_root and phase != "recompute":
            if self.stage in ("reduce", "post"):
                self.stage = "forward"  # a new micro-batch (or evaluation) after a backward
            phase = self.stage
            self._record_state()
            if self.level_now >= 1 and self._census_step != self.step_now:
                self._census_step = self.step_now
                self._record_census()
        count = self._next(self.module_counts, (phase, fqn))
        recorded = self.level_now >= 2 and self.config.in_subtree(fqn)
        self.frames.append((fqn, count, phase, recorded, is_root))
        self.scope = fqn
        if is_root and self.level_now >= 1 and phase == "forward":
            label = fqn or "model"
            n = self._next(self.phase_counts, "forward/" + label)
            pairs = list(tensor_leaves(args))
            self.record("phase", f"forward/{label}:{n}", "in", pairs, phase)
            for _, t in pairs:
                self.mark_seen(t)
            self.frames[-1] += (n,)
        if recorded:
            pairs = [(label, t) for label, t in tensor_leaves(args) if not self.is_seen(t)]
            self.record("module", f"{fqn}:{count}", "in", pairs, phase)
            for _, t in pairs:
                self.mark_seen(t)

    def _post_forward(self, module, args, kwargs=None, output=None) -> None:
        # (module, args, kwargs, output); when forward raised, torch passes fewer arguments
        if self.busy or not self.open or not self.frames:
            return
        frame = self.frames.pop()
        fqn, count, phase, recorded, is_root = frame[:5]
        self.scope = self.frames[-1][0] if self.frames else ""
        if recorded:
            leaves = list(tensor_leaves(output))
            pairs = [(label, t) for label, t in leaves if not self.is_seen(t)]
            self.record("module", f"{fqn}:{count}", "out", pairs, phase)
            for _, t in pairs:
                self.mark_seen(t)
            if phase == "forward" and torch.is_grad_enabled():
                self._hook_backward(fqn, count, leaves, list(tensor_leaves(args)))
        if is_root and len(frame) > 5:
            label = fqn or "model"
            if isinstance(kwargs, dict) and kwargs:  # keyword inputs (model(**batch)): a global pre-hook sees only positional ones
                self.record("phase", f"forward/{label}:{frame[5]}", "in", list(tensor_leaves(kwargs)), phase)
            self.record("phase", f"forward/{label}:{frame[5]}", "out", list(tensor_leaves(output)), phase)

    def _hook_backward(self, fqn: str, count: int, outputs, inputs) -> None:
        """Tensor hooks: the gradients reaching the module's outputs (the backward event's
        inputs) and its inputs (its outputs).  An input's hook sees its *total* gradient."""
        step, event = self.step_now, f"{fqn}:{count}"
        for role, pairs, tag in (("in", outputs, "grad_out"), ("out", inputs, "grad_in")):
            for label, t in pairs:
                if not t.requires_grad:
                    continue

                def hook(grad, _role=role, _label=f"{tag}{label}"):
                    if self.open and self.step_now == step:
                        self.record("module", event, _role, [(_label, grad)], "backward")

                t.register_hook(hook)

    def _make_grad_hook(self, name: str):
        owner = name.rpartition(".")[0]

        def hook(param):
            if self.open and self.level_now >= 2 and self.config.in_subtree(owner):
                self.record("module", f"{name}@grad", "out", [("grad", param.grad)], "backward")

        return hook

    # -- optimizer and autograd (rung 1) -------------------------------------------------------

    def _optimizer_params(self, optimizer):
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                yield self.param_names.get(id(param), f"group{g}.param{i}"), param

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        if not any(o is optimizer for o in self._optimizers):
            self._optimizers.append(optimizer)
        if not self.open:
            return
        if self.level_now >= 1:
            n = self.phase_counts.get("optimizer", 0)
            self.record("phase", f"reduce:{n}", "out",
                        [(name, p.grad) for name, p in self._optimizer_params(optimizer)], "reduce")
        self.stage = "optimizer"

    def optimizer_post(self, optimizer, args=None, kwargs=None) -> None:
        if not self.open:
            return
        if self.level_now >= 1:
            n = self._next(self.phase_counts, "optimizer")
            pairs = []
            for name, param in self._optimizer_params(optimizer):
                pairs.append((name, param))
                for key, value in sorted(optimizer.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        pairs.append((f"{name}.{key}", value))
            self.record("phase", f"optimizer:{n}", "out", pairs, "optimizer")
        self.stage = "post"

    def before_backward(self, kind: str, roots, grads) -> int | None:
        if not self.open:
            return None
        self.stage = "backward"
        if self.level_now < 1:
            return None
        n = self._next(self.phase_counts, kind)
        pairs = [(f"root{i}", t) for i, t in enumerate(roots) if isinstance(t, torch.Tensor)]
        pairs += [(f"grad{i}", t) for i, t in enumerate(grads or ()) if isinstance(t, torch.Tensor)]
        self.record("phase", f"{kind}:{n}", "in", pairs, "backward")
        return n

    def after_backward(self, kind: str, n: int | None, results=None) -> None:
        if not self.open:
            return
        self.stage = "reduce"
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
        for spec in self.special:
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
        was_busy, self.busy = self.busy, True
        try:
            payload = {
                "step": self.step_now, "rank": self.rank, "id": event_id, "phase": phase, "op": op,
                "call_site": site,
                "inputs": dict(self.copies(inputs)),
                "outputs": dict(self.copies(outputs)),
            }
            directory.mkdir(parents=True, exist_ok=True)
            torch.save(payload, directory / dump_filename(self.rank, self.step_now))
        finally:
            self.busy = was_busy

    def _side_dir(self) -> Path | None:
        if self.config.dump_dir is not None:
            return Path(self.config.dump_dir)
        rec = self.recorder()
        settings = getattr(rec, "settings", None)
        return getattr(settings, "directory", None)

    def _write_call_sites(self, step) -> None:
        directory = self._side_dir()
        if directory is None:
            return
        self._call_site_file_steps[str(step)] = dict(self.call_sites)
        path = directory / call_sites_filename(self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": self.rank, "steps": self._call_site_file_steps}, indent=1))
        self.call_sites = {}


def dump_filename(rank: int, step: int) -> str:
    return f"dump-rank-{rank:05d}-step-{step}.pt"


def call_sites_filename(rank: int) -> str:
    return f"trace-rank-{rank:05d}.json"


def _names_an_op(event_id: str) -> bool:
    """ATen op ids (``aten::mm:3``, ``scope/aten::mm:0``) need the dispatch mode."""
    last = event_id.rpartition("/")[2]
    return "::" in last


def _rank_of(recorder) -> int:
    rank = getattr(recorder, "rank", None)
    if rank is not None:
        return int(rank)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return int(os.environ.get("RANK", 0))


# -- torch.autograd.backward / grad -------------------------------------------------------------

_autograd_originals: dict[str, Any] = {}


def _patch_autograd() -> None:
    if _autograd_originals:
        return
    original_backward, original_grad = torch.autograd.backward, torch.autograd.grad
    _autograd_originals.update(backward=original_backward, grad=original_grad)

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        tracer = _active
        if tracer is None or not tracer.open or tracer.busy:
            return original_backward(tensors, grad_tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        grads = [grad_tensors] if isinstance(grad_tensors, torch.Tensor) else list(grad_tensors or ())
        n = tracer.before_backward("backward", roots, grads)
        result = original_backward(tensors, grad_tensors, *args, **kwargs)
        tracer.after_backward("backward", n)
        return result

    def grad(outputs, inputs, *args, **kwargs):
        tracer = _active
        if tracer is None or not tracer.open or tracer.busy:
            return original_grad(outputs, inputs, *args, **kwargs)
        roots = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        n = tracer.before_backward("grad", roots, None)
        result = original_grad(outputs, inputs, *args, **kwargs)
        tracer.after_backward("grad", n, result)
        return result

    torch.autograd.backward, torch.autograd.grad = backward, grad


def _unpatch_autograd() -> None:
    if _autograd_originals:
        torch.autograd.backward = _autograd_originals.pop("backward")
        torch.autograd.grad = _autograd_originals.pop("grad")


# -- torch.optim.Optimizer.__init__ (zero-code arming) --------------------------------------------

_optimizer_init: list = []


def _patch_optimizer_init() -> None:
    """Zero-code: a process that builds an optimizer is a training worker, so step 0 is traced
    from there (code between it and the first forward, e.g. a penalty over the parameters,
    is traced too).  Launchers and data-loader workers build none and stay unarmed."""
    if _optimizer_init:
        return
    original = torch.optim.Optimizer.__init__
    _optimizer_init.append(original)

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        tracer = _active
        if tracer is not None and not tracer.armed and not tracer.busy:
            tracer.arm()

    torch.optim.Optimizer.__init__ = __init__


def _unpatch_optimizer_init() -> None:
    if _optimizer_init:
        torch.optim.Optimizer.__init__ = _optimizer_init.pop()
