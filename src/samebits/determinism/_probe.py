"""The empirical probe: run every op several times and report the ops whose outputs differ
(docs/determinism.md, "The probe": the miss bound, what it cannot see).

Under `Probe` each op runs as trials and once for real, its bits compared (integer views)
until each input signature has been compared `comparisons` times.  Written inputs are cloned
per trial, random ops replay the same generator states, and the real execution runs last on
the program's tensors, so the program sees one execution and its RNG advances as without it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from samebits._torchutil import SAMEBITS_DIR, AutogradScopes, call_site, int_view, is_uninitialized_op
from samebits.determinism._ops import lookup_op
from samebits.verdicts import ToDict, serialised

DEFAULT_NAMESPACES = ("aten", "prims", "samebits")
# Comparisons per op signature: a race in >= 26% of executions is found with >= 95% probability;
# measured on a 4-layer encoder step: first step 5.2x unprobed (2.6x at one), later steps 2.65x.
DEFAULT_COMPARISONS = 10
MIN_COMPARISONS = 2  # one comparison is one coin toss, not a verdict
_FLUSH_EVERY = 512  # pending comparisons read back per host sync

_SKIPPED_FRAMES = (SAMEBITS_DIR + os.sep, "<frozen")  # call sites: the user's code, not samebits'


@dataclass
class ProbeFinding(ToDict):
    """An op (at one module scope and call site) whose two executions gave different bits."""

    op: str
    module: str | None
    call_site: str | None
    elements_differing: int  # in the worst call
    numel: int  # elements compared in that call
    calls: int = 0  # calls of this op at this scope and site that were compared
    calls_differing: int = 0
    known: str | None = None  # the op catalog's summary, when the op is listed
    # Executions compared with a call's first trial, over all calls, and how many differed
    # (their ratio estimates how often the race shows).  None on findings made by hand.
    comparisons: int | None = field(default=None, metadata=serialised(omit_none=True))
    comparisons_differing: int | None = field(default=None, metadata=serialised(omit_none=True))


# Why an op ran once, uncompared.  COMPUTES_NOTHING: reasons that cannot hide a race.
NOT_COMPARED_VIEW = "view: computes nothing"
NOT_COMPARED_UNINITIALISED = "output is uninitialised memory by design"
NOT_COMPARED_NO_TENSORS = "no tensor inputs or outputs"
NOT_COMPARED_NO_ELEMENTS = "outputs hold no elements"
NOT_COMPARED_PROFILER = "profiler range marker: computes nothing"
COMPUTES_NOTHING = (NOT_COMPARED_VIEW, NOT_COMPARED_UNINITIALISED, NOT_COMPARED_NO_TENSORS,
                    NOT_COMPARED_NO_ELEMENTS, NOT_COMPARED_PROFILER)


@dataclass
class NotCompared(ToDict):
    """An op that ran once, unprobed, in some calls, and why."""

    op: str
    reason: str
    calls: int  # calls not compared for this reason
    calls_compared: int = 0  # calls of the same op that were compared (other inputs)

    @property
    def computes_nothing(self) -> bool:
        return self.reason in COMPUTES_NOTHING

    def dict_extras(self) -> dict:
        return {"computes_nothing": self.computes_nothing}


def miss_bound(comparisons: int) -> dict:
    """What `comparisons` identical comparisons of an op say about a race in it: missed with
    probability <= (1-p)^comparisons, assuming independent executions; ``summary`` in words."""
    c = comparisons
    missed = {p: (1 - p) ** c for p in (0.5, 0.25, 0.1)}
    found_95 = 1 - 0.05 ** (1 / c)  # the p at which (1-p)^c = 5%
    statement = (f"each op compared at least {c} times: a race that gives an op other bits in at "
                 f"least a fraction p of its executions is missed with probability <= (1-p)^{c}")
    figures = ", ".join(f"{_percent(x)} at p = {p:.0%}" for p, x in missed.items())
    return {
        "comparisons": c,
        "missed_at_most": {f"{p:g}": x for p, x in missed.items()},
        "found_95_at_rate": found_95,
        "statement": statement,
        "summary": (f"{statement} ({figures}); a race in at least {math.ceil(found_95 * 100)}% of "
                    "executions is found with probability >= 95% (assuming independent executions)"),
    }


def _percent(x: float) -> str:
    return f"{x:.0%}" if x >= 0.01 else f"{x * 100:.2g}%"


@dataclass
class ProbeReport(ToDict):
    """What a probe saw.  `clean` is True when no op behaved nondeterministically."""

    dict_keys = ("clean", "num_ops", "num_ops_compared", "num_signatures", "min_comparisons",
                 "bound", "seconds", "findings", "not_compared")

    findings: list[ProbeFinding]
    num_ops: int  # ops dispatched while probing
    num_ops_compared: int  # op calls executed more than once and compared
    seconds: float = field(metadata=serialised(convert=lambda seconds: round(seconds, 3)))
    result: Any = field(default=None, repr=False, metadata=serialised(skip=True))  # the probed function's return value
    # Op signatures compared, and the fewest comparisons of any of them that never
    # differed (what the bound rests on); None on reports made by hand.
    num_signatures: int | None = field(default=None, metadata=serialised(omit_none=True))
    min_comparisons: int | None = field(default=None, metadata=serialised(omit_none=True))
    not_compared: list[NotCompared] | None = field(default=None, metadata=serialised(omit_none=True))

    @property
    def clean(self) -> bool:
        """No op gave different bits (see `bound` for what that rests on)."""
        return not self.findings

    @property
    def bound(self) -> dict | None:
        """`miss_bound` of the least-compared signature, None when nothing was compared."""
        return miss_bound(self.min_comparisons) if self.min_comparisons else None

    def dict_extras(self) -> dict:
        bound = self.bound
        return {"clean": self.clean} if bound is None else {"clean": self.clean, "bound": bound}


class Probe:
    """Context manager that probes every op run inside it (in this thread).  Ops outside
    ``namespaces`` (collectives, custom ops with side effects) run once, unprobed; the first call
    of a signature runs ``comparisons`` trials, later ones one; ``on_finding`` gets each new finding.
    """

    def __init__(self, *, namespaces: tuple[str, ...] = DEFAULT_NAMESPACES,
                 comparisons: int = DEFAULT_COMPARISONS,
                 on_finding: Callable[[ProbeFinding], None] | None = None):
        if not isinstance(comparisons, int) or isinstance(comparisons, bool) \
                or comparisons < MIN_COMPARISONS:
            raise ValueError(f"Probe(comparisons={comparisons!r}): give an integer of at least "
                             f"{MIN_COMPARISONS} (default {DEFAULT_COMPARISONS}); one comparison "
                             "cannot tell a rare race from none")
        self.namespaces = frozenset(namespaces)
        self.comparisons = comparisons
        self.on_finding = on_finding
        self._findings: dict[tuple, ProbeFinding] = {}
        self._pending: list[tuple[tuple, tuple, list[tuple[torch.Tensor | int, int]]]] = []
        self._module_stack: list[str] = []
        self._autograd = AutogradScopes()  # backward: the module whose forward created the running node
        self._root_names: dict[int, tuple[Any, dict[int, str]]] = {}
        self._root: torch.nn.Module | None = None
        self._calls: dict[tuple, list[int]] = {}  # finding key -> [calls, comparisons]
        self._signatures: dict[tuple, int] = {}  # op signature -> comparisons started
        self._differing_signatures: set[tuple] = set()
        self._not_compared: dict[tuple[str, str], int] = {}  # (op, reason) -> calls
        self._compared_ops: dict[str, int] = {}  # op -> calls compared
        self._hooks: list[Any] = []
        self._mode: _ProbeMode | None = None
        self.num_ops = 0
        self.num_ops_compared = 0
        self._started = 0.0
        self._seconds = 0.0

    # -- context manager ------------------------------------------------------------
    def __enter__(self) -> "Probe":
        modules = torch.nn.modules.module
        self._hooks = [
            modules.register_module_forward_pre_hook(self._forward_pre_hook),
            modules.register_module_forward_hook(self._forward_hook, always_call=True),
        ]
        self._mode = _ProbeMode(self)
        self._mode.__enter__()
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(*exc_info)
        finally:
            self._mode = None
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._seconds += time.perf_counter() - self._started
            self.flush()

    def report(self, result: Any = None) -> ProbeReport:
        """The findings so far (reads back any pending comparisons)."""
        self.flush()
        seconds = self._seconds + (time.perf_counter() - self._started if self._mode is not None else 0.0)
        clean_counts = [count for signature, count in self._signatures.items()
                        if signature not in self._differing_signatures]
        not_compared = [NotCompared(op, reason, calls, self._compared_ops.get(op, 0))
                        for (op, reason), calls in self._not_compared.items()]
        return ProbeReport(findings=list(self._findings.values()), num_ops=self.num_ops,
                           num_ops_compared=self.num_ops_compared, seconds=seconds, result=result,
                           num_signatures=len(self._signatures),
                           min_comparisons=min(clean_counts) if clean_counts else None,
                           not_compared=not_compared)

    # -- module scope ---------------------------------------------------------------
    def _module_name(self, module: torch.nn.Module) -> str:
        """Qualified name under the outermost module being run (``GPT.layers.0.attn``)."""
        if not self._module_stack:
            self._root = module
            return type(module).__name__
        qualified = self._names_under(self._root).get(id(module))
        if qualified is not None:
            return f"{self._module_stack[0]}.{qualified}" if qualified else self._module_stack[0]
        return f"{self._module_stack[-1]}.{type(module).__name__}"  # not a submodule of the root

    def _names_under(self, root: torch.nn.Module | None) -> dict[int, str]:
        if root is None:
            return {}
        cached = self._root_names.get(id(root))
        if cached is None or cached[0] is not root:
            cached = (root, {id(m): name for name, m in root.named_modules()})
            self._root_names[id(root)] = cached
        return cached[1]

    def _forward_pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        self._module_stack.append(self._module_name(module))

    def _forward_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._module_stack:
            self._module_stack.pop()

    def _scope(self) -> str | None:
        if self._module_stack:
            return self._module_stack[-1]
        if torch._C._current_autograd_node() is not None:
            name = self._autograd.running()
            return f"{name} (backward)" if name else "(backward)"
        return None

    # -- comparisons ------------------------------------------------------------------
    def _trials_for(self, signature: tuple) -> int:
        """Trials for this call: up to the target on a signature's first call, then one."""
        return max(1, self.comparisons - self._signatures.get(signature, 0))

    def _skip(self, op_name: str, reason: str) -> None:
        self._not_compared[op_name, reason] = self._not_compared.get((op_name, reason), 0) + 1

    def _record(self, op_name: str, signature: tuple,
                results: list[tuple[torch.Tensor | int, int]]) -> None:
        """One compared call: (elements differing, elements compared) per comparison."""
        self._signatures[signature] = self._signatures.get(signature, 0) + len(results)
        self.num_ops_compared += 1
        self._compared_ops[op_name] = self._compared_ops.get(op_name, 0) + 1
        key = (op_name, self._scope(), call_site(1, skip=_SKIPPED_FRAMES, with_function=False))
        self._pending.append((key, signature, results))
        on_device = any(isinstance(d, torch.Tensor) and d.device.type != "cpu" for d, _ in results)
        if len(self._pending) >= _FLUSH_EVERY or not on_device:
            self.flush()

    def flush(self) -> None:
        """Read back pending difference counts and fold them into the findings."""
        pending, self._pending = self._pending, []
        new_findings = []
        for key, signature, results in pending:
            counts = [int(d.item()) if isinstance(d, torch.Tensor) else int(d) for d, _ in results]
            stats = self._calls.setdefault(key, [0, 0])
            stats[0] += 1
            stats[1] += len(counts)
            differing = [(count, numel) for count, (_, numel) in zip(counts, results) if count]
            finding = self._findings.get(key)
            if finding is None and differing:
                entries = lookup_op(key[0])
                finding = ProbeFinding(op=key[0], module=key[1], call_site=key[2],
                                       elements_differing=0, numel=results[0][1],
                                       known=entries[0].summary() if entries else None,
                                       comparisons=0, comparisons_differing=0)
                self._findings[key] = finding
                new_findings.append(finding)
            if differing:
                self._differing_signatures.add(signature)
            if finding is None:
                continue
            finding.calls, finding.comparisons = stats
            if differing:
                finding.calls_differing += 1
                finding.comparisons_differing += len(differing)
                count, numel = max(differing)
                if count > finding.elements_differing:
                    finding.elements_differing, finding.numel = count, numel
        if self.on_finding is not None:
            for finding in new_findings:
                self.on_finding(finding)


class _ProbeMode(TorchDispatchMode):
    def __init__(self, probe: Probe):
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        probe.num_ops += 1
        if probe._module_stack:  # the autograd node this op creates (if any) is named after the module
            probe._autograd.created(probe._module_stack[-1])
        schema = func._schema
        name = schema.name
        namespace = name.split("::", 1)[0]
        # Ops run once, with the reason: other namespaces must not repeat (collectives);
        # uninitialised outputs (empty*, resize_, ...) differ by design; views compute nothing.
        reason = (NOT_COMPARED_PROFILER if namespace == "profiler" and namespace not in probe.namespaces
                  else f"namespace {namespace} not probed (collectives, custom ops)"
                  if namespace not in probe.namespaces
                  else NOT_COMPARED_UNINITIALISED if is_uninitialized_op(name)
                  else NOT_COMPARED_VIEW if _returns_alias(schema) else None)
        flat_args: list = []
        if reason is None:
            flat_args, _ = tree_flatten((args, kwargs))
            tensors = [a for a in flat_args if isinstance(a, torch.Tensor)]
            if not tensors and not any("Tensor" in str(r.type) for r in schema.returns):
                reason = NOT_COMPARED_NO_TENSORS
            else:
                reason = next((_why_not_comparable(t) for t in tensors if not _comparable(t)), None)
        if reason is not None:
            probe._skip(name, reason)
            return func(*args, **kwargs)

        mutated = _mutated_arg_positions(schema, args, kwargs)
        only_writes = all(r.alias_info is not None and r.alias_info.is_write for r in schema.returns)

        def outputs(out, written):
            # In-place and out= ops return the argument they wrote: compare it once.
            return written if only_writes else (out, written)

        signature = _signature(name, flat_args)
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        rng = _save_rng(kwargs) if seeded else None
        trials = probe._trials_for(signature)
        results = []
        reference = None
        for trial in range(trials):
            if rng is not None and trial:
                _restore_rng(rng)
            trial_args, trial_kwargs, trial_mutated = _clone_mutated(args, kwargs, mutated)
            trial_out = outputs(func(*trial_args, **trial_kwargs), trial_mutated)
            if reference is None:
                reference = trial_out  # every later execution is compared with the first
            else:
                results.append(_count_differences(reference, trial_out))
            del trial_args, trial_kwargs, trial_mutated, trial_out
        if rng is not None:
            _restore_rng(rng)
        real_out = func(*args, **kwargs)
        real_mutated = [_get_arg(args, kwargs, pos) for pos in mutated]
        results.append(_count_differences(reference, outputs(real_out, real_mutated)))
        if any(numel or differing for differing, numel in results):
            probe._record(name, signature, results)
        else:
            probe._skip(name, NOT_COMPARED_NO_ELEMENTS)
        return real_out


# -- helpers ---------------------------------------------------------------------------

def _returns_alias(schema) -> bool:
    """View ops (outputs alias an input without writing it): no computation to compare."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _comparable(t: torch.Tensor) -> bool:
    return (t.layout == torch.strided and not t.is_quantized and not t.is_nested
            and t.device.type != "meta" and type(t) in (torch.Tensor, torch.nn.Parameter))


def _why_not_comparable(t: torch.Tensor) -> str:
    """The reason `_comparable` refuses ``t``, for the not-compared list."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return f"tensor subclass input ({type(t).__name__}): its inner ops are not seen"
    if t.layout != torch.strided:
        return f"{str(t.layout).replace('torch.', '')} input"
    if t.is_quantized:
        return "quantized input"
    if t.is_nested:
        return "nested tensor input"
    return "meta tensor input: holds no values"


def _signature(name: str, flat_args: list) -> tuple:
    """The op and what of its arguments picks its kernel (`_signature_part`), hashable."""
    signature = (name, *map(_signature_part, flat_args))
    try:
        hash(signature)
    except TypeError:  # an argument type we do not know: its type stands in for it
        signature = (name, *(type(a) for a in flat_args))
    return signature


def _signature_part(arg: Any) -> Any:
    """What of an argument may pick an op's kernel and split: a tensor's dtype, shape, strides
    and device, a non-float scalar's value; a float's type only (a learning rate changes)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, tuple(arg.shape), tuple(arg.stride()) if _comparable(arg) else (),
                str(arg.device))
    if isinstance(arg, float):
        return float
    if arg is None or isinstance(arg, (bool, int, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
        return arg
    return type(arg)


def _mutated_arg_positions(schema, args, kwargs) -> list[int | str]:
    """Positions (int) or keyword names (str) of the arguments the op writes."""
    positions: list[int | str] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            if not arg.kwarg_only and i < len(args):
                positions.append(i)
            elif arg.name in kwargs:
                positions.append(arg.name)
    return positions


def _get_arg(args, kwargs, pos):
    return args[pos] if isinstance(pos, int) else kwargs[pos]


def _clone_mutated(args, kwargs, mutated):
    """Copies of args/kwargs with every written tensor cloned; written tensors that share a
    storage share one cloned storage, so ``a.add_(a[::2])`` behaves as in the real execution."""
    if not mutated:
        return args, kwargs, []
    written = [_get_arg(args, kwargs, pos) for pos in mutated]
    flat, _ = tree_flatten(written)
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in flat:
        if isinstance(t, torch.Tensor):
            by_storage.setdefault(_storage_key(t), []).append(t)
    replacement: dict[int, torch.Tensor] = {}
    for tensors in by_storage.values():
        if len(tensors) == 1 and not _may_overlap(tensors[0]):
            t = tensors[0]  # same sizes and strides, only the viewed elements copied
            replacement[id(t)] = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                                     device=t.device).copy_(t)
            continue
        storage = tensors[0].untyped_storage()
        copy = storage.clone() if hasattr(storage, "clone") else storage.copy_(storage)
        for t in tensors:
            replica = torch.empty(0, dtype=t.dtype, device=t.device)
            replica.set_(copy, t.storage_offset(), t.size(), t.stride())
            replacement[id(t)] = replica

    def swap(x):
        if isinstance(x, torch.Tensor):
            return replacement.get(id(x), x)
        if isinstance(x, (list, tuple)):
            return type(x)(swap(v) for v in x)
        return x

    new_args, new_kwargs = list(args), dict(kwargs)
    for pos in mutated:
        (new_args if isinstance(pos, int) else new_kwargs)[pos] = swap(_get_arg(args, kwargs, pos))
    trial_written = [_get_arg(new_args, new_kwargs, pos) for pos in mutated]
    return tuple(new_args), new_kwargs, trial_written


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr() or id(t)
    except RuntimeError:
        return id(t)


def _may_overlap(t: torch.Tensor) -> bool:
    """Expanded (stride 0) tensors: elements share memory, so clone the whole storage."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.size(), t.stride()))


def _save_rng(kwargs) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    generator = kwargs.get("generator")
    if isinstance(generator, torch.Generator):
        state["generator"] = (generator, generator.get_state())
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "generator" in state:
        state["generator"][0].set_state(state["generator"][1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the tensor's bits (a complex one's parts): NaN-safe, and -0.0 differs from 0.0."""
    return int_view(torch.view_as_real(t) if t.is_complex() else t)


def _count_differences(trial: Any, real: Any) -> tuple[torch.Tensor | int, int]:
    """(elements that differ, elements compared) over all tensors and scalars in the outputs."""
    trial_flat, _ = tree_flatten(trial)
    real_flat, _ = tree_flatten(real)
    if len(trial_flat) != len(real_flat):
        return 1, 1
    differing: torch.Tensor | int = 0
    numel = 0
    synced = False
    for a, b in zip(trial_flat, real_flat):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not (_comparable(a) and _comparable(b)):
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                both = max(a.numel(), b.numel(), 1)
                differing, numel = differing + both, numel + both
                continue
            if not synced and a.device.type == "cpu" and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # a non_blocking device-to-host copy may be in flight
                synced = True
            numel += a.numel()
            if not a.numel():
                continue
            bits_a, bits_b = _bits(a), _bits(b)
            if a.device.type == "cpu":
                # NumPy's comparison is several times faster than torch.equal here (measured
                # on 4 MB tensors); count only when something differs.
                np_a, np_b = bits_a.detach().numpy(), bits_b.detach().numpy()
                if not np.array_equal(np_a, np_b):
                    differing = differing + int(np.count_nonzero(np_a != np_b))
            else:
                # Stays on the device: read back in batches by Probe.flush, not per op.
                differing = differing + (bits_a != bits_b).sum()
        elif isinstance(a, float) and isinstance(b, float):
            numel += 1
            differing = differing + (0 if a == b or (a != a and b != b) else 1)
        elif isinstance(a, (int, bool, complex)) and isinstance(b, type(a)):
            numel += 1
            differing = differing + (0 if a == b else 1)
    return differing, numel


def probe(fn: Callable, *args, **kwargs) -> ProbeReport:
    """Run ``fn(*args, **kwargs)`` (e.g. one training step) under a default `Probe`; the report's
    ``result`` holds fn's return value."""
    with Probe() as active:
        result = fn(*args, **kwargs)
    return active.report(result)
