"""Zero-code recording: fingerprint any training script without editing it.

`samebits run --out DIR -- CMD` puts `samebits._inject` first on ``PYTHONPATH``; its
``sitecustomize`` calls `install()` in every Python process CMD starts.  `install` adds global
hooks and makes no recorder until one fires (launchers and data-loader workers record nothing):
an optimizer step post-hook (params, grads, optimizer state; a step is one outermost
``optimizer.step()``), a forward hook on *top-level* modules (phase ``forward``), a wrapper
around ``torch.autograd.backward`` (the root, phase ``backward``), and an atexit close that
leaves an outcome file (`_outcome`) so a launcher never takes a crash for a finished run.

The state census (``state``, ``inputs``, ``state_end``, and ``restored.*`` in a process's first
step) goes to the census stream ``SAMEBITS_DIR/state`` (docs/checkpoint.md, "The state
census"; docs/resume.md); generator events to ``state/events-rank-N.jsonl``; `note` lines to
``notes-rank-N.jsonl``.  With ``SAMEBITS_REFERENCE`` set, the first step whose root differs
stops the process with `EXIT_STOPPED` and ``stopped.json``.

Fail-safe: every hook runs samebits' work inside `samebits.stream.gaps.guard`; an exception of
ours becomes a gap, never the program's.  Only the eager training step is recorded (no
recompute in backward, functorch transform, dynamo trace, export or fake tensor).  Settings:
`samebits.settings.RecordingSpec` (`recording_variables`), ``SAMEBITS_DIR``,
``SAMEBITS_STEP_OFFSET``, ``SAMEBITS_REFERENCE``; ``SAMEBITS_TRACE*`` installs `samebits.trace`.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from samebits import settings
from samebits._torchutil import optimizer_params, outside_dispatch_modes, process_rank, tensor_leaves
from samebits._inject import with_injection
from samebits.stream.gaps import guard, inject, read_gaps, record_gap, summarise_gaps
from samebits.autorecord._tracking import Tracking, install_tracking
from samebits.autorecord._outcome import (STOPPED_MARKER, TRACEBACK_LINES, read_outcomes, read_stop, write_outcome,
                                          write_stop)
from samebits.checkpoint import CENSUS_DIR, census_recorder, state_census
from samebits.errors import ConfigError
from samebits.settings import RecordingSpec
from samebits.stream import Recorder
from samebits.stream.optimizer_state import state_tensors
from samebits.stream.phases import (AFTER_OPTIMIZER_STEP, BACKWARD, FORWARD, INPUTS, RESTORED_OPTIMIZER,
                                    RESTORED_PARAMS, STATE, STATE_END)
from samebits.trace import install_zero_code
from samebits.verdicts import EXIT_STOPPED  # the live check stopped the run at a step that differs

ENV_ENABLE = "SAMEBITS_AUTORECORD"
STATE_DIR = CENSUS_DIR  # the census stream's folder inside a run directory (samebits.checkpoint.CENSUS_DIR)
EVENTS_FILE = "events-rank-{rank:05d}.jsonl"  # in STATE_DIR: restores, seeds and draws of the global generators
NOTES_FILE = "notes-rank-{rank:05d}.jsonl"  # in the run directory: what a callback found (`note`)

_state = None


class _AutoRecorder:
    def __init__(self):
        self.recorder = None
        self.ended = False  # the exit work ran (atexit, or an os._exit the program called)
        self.step = settings.read("SAMEBITS_STEP_OFFSET")
        self.first_optimizer = None
        self.param_names: dict[int, str] = {}
        self.depth = 0  # nesting of module forwards: 0 means a top-level call
        self.top_level_seen: dict[int, torch.nn.Module] = {}
        self.tracer = None  # samebits.trace.Tracer when SAMEBITS_TRACE* asks for one
        self.optimizers: list[torch.optim.Optimizer] = []  # in the order their first step ran
        self.census = None  # the state census Recorder (SAMEBITS_DIR/state)
        self.census_step: int | None = None  # the last step whose census is recorded
        self.exception: BaseException | None = None  # an uncaught one, seen by sys.excepthook
        self.exception_tail: list[str] = []
        self.tracking = Tracking(lambda: self.step)  # what the program made, from construction
        self.first_step = self.step  # a resumed process starts here
        self.census_open: int | None = None  # the census step written at the step's end
        self.forwards: list[bool] = []  # per module call in progress: whether its hooks record
        self.state_was_empty: dict[int, bool] = {}  # optimizer id -> no state when its step began

    def _rec(self):
        if self.recorder is None:
            reference = settings.read("SAMEBITS_REFERENCE") or None
            config = {"command": settings.read("SAMEBITS_COMMAND") or ""}
            append = settings.read("SAMEBITS_APPEND")
            self.recorder = Recorder(append=append, reference=reference, config=config)
            self.census = census_recorder(self.recorder, append=append, config=config)
        return self.recorder

    def _ours(self):
        """Our own torch work (census, detach, digests): untraced, and unseen by any other
        dispatch mode in force (selective activation checkpointing's, a user's)."""
        return self.tracer.suspended() if self.tracer is not None else outside_dispatch_modes()

    def _tracked(self, live) -> list:
        return [obj for obj, _ in live.alive()]

    def record_census(self) -> None:
        """The state census at the start of ``self.step`` (once), left open for the step's inputs."""
        if self.census_step == self.step:
            return
        self.census_step = self.step
        self._rec()
        if self.census is None:
            return
        tracking = self.tracking
        with guard("census", step=self.step, records="the state census"):
            optimizers = self._tracked(tracking.optimizers)
            optimizers += [o for o in self.optimizers if not any(o is seen for seen in optimizers)]
            # A container (torchtitan's OptimizersContainer) holds no state of its own: its
            # inner optimizers, tracked from their construction, are the census's.
            optimizers = [o for o in optimizers if not _inner_optimizers(o)]
            with self._ours():
                self._close_census_step()
                self.census.tensors(self.step, STATE,
                                    state_census(optimizers=optimizers,
                                                 schedulers=self._tracked(tracking.schedulers),
                                                 scalers=self._tracked(tracking.scalers),
                                                 generators=tracking.named_generators())
                                    + tracking.census_records())
                if self.step == self.first_step:  # a fresh process too: its initial parameters
                    self._record_restored(optimizers)
        self.census_open = self.step

    def _record_restored(self, optimizers) -> None:
        """Parameters and optimizer state as the process's first step begins, named as the main stream's."""
        params, state = _params_and_state(optimizers, self.param_names)
        params = [(name, _local(param.detach())) for name, param in params]
        state = [(name, _local(value)) for name, value in state]
        if not params:
            for module in self.top_level_seen.values():
                params += [(self.param_names.get(id(p), n), _local(p.detach())) for n, p in module.named_parameters()]
        self.census.tensors(self.step, RESTORED_PARAMS, params)
        self.census.tensors(self.step, RESTORED_OPTIMIZER, state)

    def _close_census_step(self) -> None:
        """Write the open census step: its ``state_end`` (the generators now), then the events."""
        step, self.census_open = self.census_open, None
        if step is None or self.census is None:
            return
        self.census.tensors(step, STATE_END,
                            state_census(generators=self.tracking.named_generators()))
        self.tracking.release()
        self.census.end_step(step)
        self._write_events()

    def _write_events(self) -> None:
        events = self.tracking.new_events()
        if not events or self.census is None:
            return
        path = self.census.settings.directory / EVENTS_FILE.format(rank=self.census.rank)
        with open(path, "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(event) + "\n" for event in events)

    # how the user's code ended: the launcher reads it (see _outcome)
    def excepthook(self, kind, value, tb) -> None:
        self.exception = value
        with guard("exit", step=self.step, records="the uncaught exception's traceback"):
            lines = "".join(traceback.format_exception(kind, value, tb)).rstrip().splitlines()
            self.exception_tail = lines[-TRACEBACK_LINES:]

    def at_exit(self) -> None:
        if self.ended:
            return
        self.ended = True
        with guard("exit", step=self.step, records="the streams' close and the outcome file"):
            self._at_exit()

    def _at_exit(self) -> None:
        if self.recorder is None and (self.exception is None or process_rank() is None):
            return  # a launcher (torchrun's agent reports its workers' failure) or a helper process
        streams_closed = True
        try:
            with self._ours():
                self._close_census_step()
        except Exception:  # noqa: BLE001 - say so in the outcome rather than hide it
            streams_closed = False
        for recorder in (self.recorder, self.census):
            if recorder is not None:
                try:
                    recorder.close()
                except Exception:  # say so in the outcome rather than hide it
                    streams_closed = False
        directory = settings.read("SAMEBITS_DIR")
        if not directory:
            return
        rank = self.recorder.rank if self.recorder is not None else process_rank()
        raised = {} if self.exception is None else {
            "exception": f"{type(self.exception).__name__}: {self.exception}", "traceback_tail": self.exception_tail}
        write_outcome(directory, rank=rank, ended="exception" if raised else "clean", streams_closed=streams_closed,
                      step=self.step, **raised)

    def stop(self, step: int) -> None:
        """The live check found ``step`` differs from the reference: say so and end the process."""
        rec = self.recorder
        reference = settings.read("SAMEBITS_REFERENCE") or ""
        print(f"samebits: step {step} on rank {rec.rank} differs from the reference run {reference} "
              f"(its step root); stopping here, exit code {EXIT_STOPPED}. Details: samebits diff "
              f"{reference} {rec.settings.directory} --to-step {step + 1}", file=sys.stderr, flush=True)
        with self._ours():
            self._close_census_step()
        for recorder in (rec, self.census):
            if recorder is not None:
                recorder.close()
        write_stop(rec.settings.directory, step=step, rank=rec.rank, reference=reference)
        write_outcome(rec.settings.directory, rank=rec.rank, ended="stopped", streams_closed=True, step=step)
        self.ended = True
        sys.stdout.flush()
        # Not SystemExit: the script's own handlers would run on into collectives and hang.
        os._exit(EXIT_STOPPED)

    # forward hooks: count nesting so only top-level outputs are recorded
    def pre_forward(self, module, args):
        if _compiling():  # first, and nothing else: dynamo folds this to True and traces no more of us
            return
        # not a recompute in backward, a transform, a trace, an export, nor a shape-only forward
        # on the meta device (litgpt's FLOP count runs its model under ``torch.device("meta")``;
        # asked of top-level calls only: a submodule of a recorded forward is on its device)
        records = _observable() and not (self.depth == 0 and _on_meta(module, args))
        self.forwards.append(records)
        if not records:
            return
        if self.depth == 0:
            with guard("forward_pre", step=self.step, records="the step's census and inputs"):
                self.tracking.begin()
                self._name_params(module)
                if torch.is_grad_enabled():
                    self.record_census()
                self._record_inputs(module, args)
        self.depth += 1

    def _record_inputs(self, module, tree) -> None:
        """The tensors of a top-level forward's arguments ``tree``, while the step's census is open."""
        if self.census is None or self.census_step != self.step:
            return
        inputs = [(n, t) for n, t in tensor_leaves(tree, type(module).__name__) if _recordable(t)]
        if inputs:
            with self._ours():
                self.census.tensors(self.step, INPUTS, [(n, _local(t.detach())) for n, t in inputs])

    def _name_params(self, module) -> None:
        """Name a top-level module's parameters the first time it runs."""
        if id(module) not in self.top_level_seen:
            self.top_level_seen[id(module)] = module
            prefix = ""
            if any(m is not module for m in self.top_level_seen.values()):
                prefix = type(module).__name__ + "."
            for name, param in module.named_parameters():
                self.param_names.setdefault(id(param), prefix + name)

    def post_forward(self, module, args, kwargs, output):
        if _compiling():
            return
        if not (self.forwards.pop() if self.forwards else False):
            return
        self.depth -= 1
        if self.depth != 0:
            return
        if kwargs and self.census is not None and self.census_step == self.step:
            # The batch given by keyword (HF's ``model(**inputs)``): a global pre-hook sees only
            # the positional arguments, so the keywords are read here, as the forward returns.
            with guard("forward", step=self.step, records=f"the keyword inputs of {type(module).__name__}.forward"):
                self._record_inputs(module, kwargs)
        with guard("forward", step=self.step, records=f"the outputs of {type(module).__name__}.forward"):
            leaves = [(n, t) for n, t in tensor_leaves(output, type(module).__name__) if _recordable(t)]
            if leaves:
                with self._ours():
                    self._rec().tensors(self.step, FORWARD, [(n, _local(t.detach())) for n, t in leaves])

    def backward_root(self, tensors) -> None:
        """Record the root(s) of a ``backward()`` call at the current step."""
        if _compiling() or not _observable(in_backward_too=True):
            return
        with guard("backward", step=self.step, records="the backward() root"):
            roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            named = [("root" if len(roots) == 1 else f"root.{index}", root) for index, root in enumerate(roots)
                     if isinstance(root, torch.Tensor) and _recordable(root)]
            if not named:
                return
            rec = self._rec()
            with self._ours():
                for name, root in named:
                    root = _local(root.detach())
                    if root.numel() == 1 and root.layout == torch.strided and not root.is_nested:
                        rec.metrics(self.step, phase=BACKWARD, **{name: root.reshape(())})
                    else:
                        rec.tensors(self.step, BACKWARD, [(name, root)])

    def before_optimizer_step(self, optimizer, args, kwargs) -> None:
        with guard("optimizer_step", step=self.step, records="the optimizer step's state check"):
            self.state_was_empty[id(optimizer)] = not any(inner.state for inner in _effective(optimizer))

    def after_optimizer_step(self, optimizer, args, kwargs):
        was_empty = self.state_was_empty.pop(id(optimizer), False)
        if _inside_another_optimizer_step(optimizer):
            return  # a container's inner optimizer (torchtitan's, accelerate's): the container records
        if was_empty and _is_state_init_step(optimizer):
            return  # a zero-LR step that only creates the state (DCP's and torchtitan's checkpoint load)
        ended = False
        with guard("optimizer_step", step=self.step, records="parameters, gradients and optimizer state"):
            ended = self._after_optimizer_step(optimizer)
        if ended:
            self._end_step()

    def _after_optimizer_step(self, optimizer) -> bool:
        """Record the step's params, grads and optimizer state; True if ``optimizer``'s step ends it."""
        if self.first_optimizer is None:
            self.first_optimizer = optimizer
        if not any(seen is optimizer for seen in self.optimizers):
            self.optimizers.append(optimizer)
        rec = self._rec()
        number = None if optimizer is self.first_optimizer else self._optimizer_number(optimizer)
        names, state = _params_and_state(_effective(optimizer), self.param_names)
        with self._ours():
            grads, params = [(n, p.grad) for n, p in names], [(n, p.detach()) for n, p in names]
            # A phase holding shards records the local shards and the whole tensors.
            whole = [phase for phase, named in zip(AFTER_OPTIMIZER_STEP, (grads, params, state))
                     if any(_is_dtensor(t) for _, t in named)]
            rec.optimizer_step(self.step, grads=grads, params=params, optimizer=state, number=number, whole=whole)
        if self.tracer is not None:
            self.tracer.optimizer_post(optimizer)
        return optimizer is self.first_optimizer

    def _optimizer_number(self, optimizer) -> int:
        """A stable number for an optimizer that does not end the step: its construction order, else first step's."""
        for number, made in enumerate(self._tracked(self.tracking.optimizers)):
            if made is optimizer:
                return number
        return next(number for number, seen in enumerate(self.optimizers) if seen is optimizer)

    def _end_step(self) -> None:
        """The step's last records, its frame, then the next step (the live check may stop here)."""
        tracer = self.tracer
        stop = False
        with guard("step_end", step=self.step, records="the step's end"):
            if tracer is not None:
                tracer.finish_step(self.step)  # its records belong before the step is written
            if self.census_step != self.step:
                self.tracking.begin()
                self.record_census()  # a step without a top-level forward still has its census
            with self._ours():
                self._close_census_step()
            stop = self.recorder is not None and self.recorder.end_step(self.step) is False
        if stop:
            self.stop(self.step)
        self.step += 1
        if tracer is not None:
            with guard("step_end", step=self.step - 1, records="the tracer's step end"):
                tracer.after_end_step(self.step - 1)  # may end the process (a bisect re-run)
                tracer.begin_step(self.step)


def install() -> bool:
    """Install the global hooks once (idempotent); True if recording is on."""
    global _state
    if _state is not None:
        return True
    if settings.read("SAMEBITS_DISABLE"):
        return False
    inject("startup")  # fault-injection tests: sitecustomize records the whole process as a gap
    state = _AutoRecorder()
    previous_hook = sys.excepthook

    def excepthook(kind, value, tb):
        state.excepthook(kind, value, tb)
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(state.at_exit)  # registered first, so it runs after the script's own handlers
    if any(settings.is_set(name) for name in _TRACE_VARIABLES):
        state.tracer = install_zero_code(state._rec, state.step)  # a bad setting raises here, first
        state.tracking.watch_draws = False  # the tracer's own dispatch modes come and go
    _state = state
    with guard("tracking", records="the training state's construction (census context)"):
        install_tracking(state.tracking)
    register_module_forward_pre_hook(_state.pre_forward)
    register_module_forward_hook(_state.post_forward, with_kwargs=True, always_call=True)
    register_optimizer_step_pre_hook(_state.before_optimizer_step)
    register_optimizer_step_post_hook(_state.after_optimizer_step)
    _wrap_backward(_state)
    _wrap_exit(_state)
    return True


def note(owner: str, message: str, step: int | None = None) -> bool:
    """Leave a finding of a callback or library in the recorded run, shown by `samebits verify`
    with its verdict; False when this process records no run."""
    directory = settings.read("SAMEBITS_DIR")
    if not directory:
        return False
    rank = process_rank() or 0
    entry = {"owner": owner, "message": message, "rank": rank,
             "step": step if step is not None else (_state.step if _state is not None else None)}
    try:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, NOTES_FILE.format(rank=rank)), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(entry) + "\n")
    except OSError:
        return False
    return True


_compiling = torch.compiler.is_compiling  # dynamo answers True while it traces: our hooks vanish from graphs


def _observable(in_backward_too: bool = False) -> bool:
    """Whether a module call (or backward root) now is the program's own eager training step:
    not a recompute in backward, a functorch transform, a dynamo trace, an export or fake mode."""
    try:
        if not in_backward_too and torch._C._current_graph_task_id() != -1:
            return False  # the engine is running a backward: a forward now is a recompute
        if torch._C._are_functorch_transforms_active():
            return False
        compiler = getattr(torch, "compiler", None)
        if compiler is not None and (compiler.is_compiling() or getattr(compiler, "is_exporting", bool)()):
            return False
        return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None
    except Exception:  # noqa: BLE001 - an older torch: record as before
        return True


def _on_meta(module, args) -> bool:
    """A shape-only forward: the module's parameters (or first tensor argument) are on meta."""
    try:
        first = next(module.parameters(), None)
        if first is None:
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        return first is not None and first.device.type == "meta"
    except Exception:  # noqa: BLE001 - a module whose parameters cannot be listed: record as before
        return False


def _recordable(tensor) -> bool:
    """A plain tensor, parameter or DTensor with real data; no functorch wrapper, fake, meta or other subclass."""
    if not isinstance(tensor, torch.Tensor):
        return False
    if _is_dtensor(tensor):
        return True
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type == "meta":
        return False
    try:
        return not torch._C._functorch.is_functorch_wrapped_tensor(tensor)
    except Exception:  # noqa: BLE001
        return True


def _is_dtensor(tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, getattr(dtensor, "DTensor", ()))


def _inner_optimizers(optimizer) -> list:
    """The optimizers a container steps (torchtitan's ``.optimizers``, accelerate's ``.optimizer``)."""
    found = []
    for attribute in ("optimizers", "optimizer"):
        value = optimizer.__dict__.get(attribute) if hasattr(optimizer, "__dict__") else None
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [v for v in values if isinstance(v, torch.optim.Optimizer) and v is not optimizer]
    return found


def _effective(optimizer) -> list:
    """The optimizers ``optimizer``'s step updates: a container's inner ones, recursively, else itself."""
    inner = _inner_optimizers(optimizer)
    if not inner:
        return [optimizer]
    return [leaf for opt in inner for leaf in _effective(opt)]


def _inside_another_optimizer_step(optimizer) -> bool:
    """Whether ``optimizer.step()`` runs inside another optimizer's ``step`` (a container
    stepping its inner optimizers): only the outermost step is a training step.  Read from
    the Python stack, so an exception in an earlier step cannot leave a stale count behind."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "step":
            owner = frame.f_locals.get("self")
            # Only an outer step that runs the step hooks itself counts (torch patches the
            # ``step`` of classes whose __init__ ran Optimizer's): accelerate's wrapper does not.
            if owner is not optimizer and isinstance(owner, torch.optim.Optimizer) and \
                    getattr(getattr(type(owner), "step", None), "hooked", False):
                return True
        frame = frame.f_back
    return False


def _is_state_init_step(optimizer) -> bool:
    """A step that only creates the optimizer's state: it had no state when it began, every
    group that has a learning rate has 0, and every gradient is None or zero.  That is how
    checkpoint loaders materialise Adam's moments before loading into them (DCP's
    ``_init_optim_state``, torchtitan's ``init_optim_state``); a training step with a warm-up
    LR of 0 has real gradients.  Costs a check of the gradients only when the LR is 0."""
    try:
        groups = [group for opt in _effective(optimizer) for group in opt.param_groups]
        lrs = [group["lr"] for group in groups if "lr" in group]
        if not lrs or any(float(lr) != 0.0 for lr in lrs):
            return False
        with outside_dispatch_modes():
            for group in groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is not None and bool(_local(grad).ne(0).any()):
                        return False
        return True
    except Exception:  # noqa: BLE001 - when in doubt it is a training step, as before
        return False


def _params_and_state(optimizers, param_names) -> tuple[list, list]:
    """(name, parameter) once each, and its state tensors as (``NAME.KEY``, tensor), in order."""
    params, state, seen = [], [], set()
    for optimizer in optimizers:
        for name, param in optimizer_params(optimizer, param_names):
            if id(param) not in seen:
                seen.add(id(param))
                params.append((name, param))
                state += state_tensors(optimizer, name, param)
    return params, state


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (the recorded stream is per rank); other tensors as they are."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _wrap_backward(state: _AutoRecorder) -> None:
    """Record every ``backward()`` root, then run the backward that was there (the tracer's or torch's)."""
    previous = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        state.backward_root(tensors)  # fail-safe: its own guard
        return previous(tensors, *args, **kwargs)

    backward.__wrapped__ = previous
    backward.__doc__ = previous.__doc__
    torch.autograd.backward = backward


def _wrap_exit(state: _AutoRecorder) -> None:
    """A program that ends with ``os._exit`` skips atexit (the reference recipe does, to skip C++
    static destructors): samebits' exit work (closing the streams, the outcome file) runs first,
    then the real ``os._exit``.  Only in the process that installed the hooks: a forked child (a
    DataLoader or multiprocessing worker) ends with ``os._exit`` too and must leave its parent's
    streams alone."""
    real_exit, pid = os._exit, os.getpid()

    def _exit(status):
        if os.getpid() == pid:
            state.at_exit()  # fail-safe: its own guard; runs once
        real_exit(status)

    _exit.__wrapped__ = real_exit
    _exit.__doc__ = real_exit.__doc__
    os._exit = _exit


_TRACE_VARIABLES = ("SAMEBITS_TRACE", "SAMEBITS_TEST_PERTURB", "SAMEBITS_TRACE_DUMP_OP", "SAMEBITS_TRACE_STOP_AFTER")


def recording_variables(*, spec: RecordingSpec | None = None, **what) -> dict[str, str | None]:
    """What to record, as the ``SAMEBITS_*`` variables every Recorder reads (None: unset): ``spec``
    (default: everything) with the `RecordingSpec` fields in ``what`` in place of its own.  A bad
    value is refused here, naming its variable, before any process starts."""
    options = RecordingSpec.options()
    unknown = sorted(set(what) - set(options))
    if unknown:
        raise ConfigError(f"recording_variables: {', '.join(unknown)} is not something to record; the choices are "
                          f"{', '.join(options)} (samebits.RecordingSpec).")
    given = {name: options[name].normalise(value, options[name].env) for name, value in what.items()
             if value is not None}
    return (spec or RecordingSpec()).replace(**given).to_env()


def with_variables(env, variables: dict[str, str | None]) -> dict[str, str]:
    """``env`` with ``variables`` set, and those that are None removed."""
    env = dict(env)
    for key, value in variables.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def environment_for(out_dir, *, reference=None, step_offset=None, append=False, command="",
                    **what) -> dict[str, str]:
    """The environment that makes every Python process of a command record (`recording_variables`)."""
    env = with_injection(os.environ)
    env[ENV_ENABLE] = "1"
    # Absolute: a program that changes its working folder (Lightning's demo, a launcher) must
    # still write its streams where the caller reads them.
    env["SAMEBITS_DIR"] = os.path.abspath(out_dir)
    env["SAMEBITS_COMMAND"] = command
    variables = recording_variables(**what)
    variables.update({"SAMEBITS_REFERENCE": None if reference is None else os.path.abspath(reference),
                      "SAMEBITS_STEP_OFFSET": None if step_offset is None else str(step_offset),
                      "SAMEBITS_APPEND": "1" if append else None})
    return with_variables(env, variables)


__all__ = ["install", "environment_for", "recording_variables", "with_variables", "read_outcomes", "read_stop",
           "read_gaps", "summarise_gaps", "record_gap",
           "STOPPED_MARKER", "STATE_DIR", "EVENTS_FILE", "NOTES_FILE", "EXIT_STOPPED", "ENV_ENABLE", "note"]
