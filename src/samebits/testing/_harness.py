"""The byte-test harness: run a function several times on fresh copies of its inputs and
compare every output and every gradient bit for bit; negative controls; background load.

One run = reseed the RNGs, copy the inputs, call, run the backward with fixed cotangents,
collect the leaves (outputs, gradients, module parameters and buffers).  Runs repeat at each
thread count asked for, optionally while a background workload competes for the cores.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from samebits.errors import ConfigError
from samebits.testing import _options
from samebits.testing._bits import Leaf, Mismatch, compare, flatten, members, render, tensor_leaf

_COTANGENT_SEED = 0x5A3E  # the same gradient of the outputs in every run


@dataclasses.dataclass
class BitwiseReport:
    """What a byte test compared: the leaves of each run and the runs that differed."""

    name: str
    runs: list[dict]  # one per run: {"threads": n, "contention": bool}
    paths: list[str]  # every compared value (outputs, gradients, parameters, buffers)
    num_gradients: int
    differing_runs: list[int]  # indices into `runs` that differ from run 0
    mismatches: list[Mismatch]  # of the first differing run
    counts: dict[str, int]  # path -> number of runs (besides run 0) where it differs

    @property
    def ok(self) -> bool:
        return not self.differing_runs

    def message(self) -> str:
        if self.ok:
            return (f"{self.name}: {len(self.runs)} runs bitwise equal ({len(self.paths)} values, "
                    f"{self.num_gradients} gradients)")
        first = self.differing_runs[0]
        header = (f"{self.name} is not bitwise repeatable: {len(self.differing_runs)} of "
                  f"{len(self.runs) - 1} runs differ from run 0 ({_describe_run(self.runs[0])}); first "
                  f"differing run: {first} ({_describe_run(self.runs[first])})")
        text = render(self.mismatches, header=header)
        spread = ", ".join(f"{path}: {count} run(s)" for path, count in list(self.counts.items())[:8])
        return text + f"\n  runs that disagree, per value: {spread}"


def _describe_run(run: dict) -> str:
    return f"threads={run['threads']}" + (", under contention" if run["contention"] else "")


# -- collecting one run -------------------------------------------------------------------

def _walk(value: Any, path: str):
    """Yield (path, object) for every tensor and module inside a nested structure."""
    if isinstance(value, (torch.Tensor, torch.nn.Module)):
        yield path, value
        return
    for item, item_path in members(value, path) or ():
        yield from _walk(item, item_path)


def _without_modules(value: Any) -> Any:
    """The structure with each module replaced by None (modules are collected apart)."""
    if isinstance(value, torch.nn.Module):
        return None
    if isinstance(value, Mapping):
        return {key: _without_modules(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_without_modules(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_without_modules(item) for item in value)
    return value


def collect(result: Any, *, grads: bool, grad_sources: Any = None, path: str = "output") -> tuple[list[Leaf], int]:
    """The leaves of one run: ``result``'s values and, with ``grads``, the gradients of its
    tensors, of ``grad_sources`` and of every module's parameters after a backward with fixed
    cotangents (none when the code ran its own backward)."""
    found = list(_walk(result, path))
    if grad_sources is not None:
        found += list(_walk(grad_sources, "input"))
    outputs = [t for p, t in found if p.startswith(path) and isinstance(t, torch.Tensor)
               and t.requires_grad and t.grad_fn is not None]
    sources: list[tuple[str, torch.Tensor]] = []
    for p, obj in found:
        if isinstance(obj, torch.nn.Module):
            sources += [(f"{p}.{name}", param) for name, param in obj.named_parameters()]
        elif obj.requires_grad and obj.grad_fn is None:
            sources.append((p, obj))
    if grads and outputs and not any(t.grad is not None for _, t in sources):
        gen = torch.Generator().manual_seed(_COTANGENT_SEED)
        cotangents = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.dtype).to(t.device)
                      if t.is_floating_point() else torch.ones_like(t) for t in outputs]
        torch.autograd.backward(outputs, cotangents)
    leaves = flatten(_without_modules(result), path)
    for p, obj in found:
        if isinstance(obj, torch.nn.Module):
            leaves += [tensor_leaf(t, f"{p}.{name}") for name, t in obj.named_parameters()]
            leaves += [tensor_leaf(t, f"{p}.{name} (buffer)") for name, t in obj.named_buffers()]
    num_gradients = 0
    if grads:
        seen = set()
        for p, t in sources:
            if id(t) in seen:
                continue
            seen.add(id(t))
            if t.grad is not None:
                leaves.append(tensor_leaf(t.grad, f"grad of {p}"))
                num_gradients += 1
            else:
                leaves.append(Leaf(f"grad of {p}", None, None, None))
    return leaves, num_gradients


def fresh(value: Any, grads: bool) -> Any:
    """A copy of the inputs for one run: tensors cloned (floating ones require grad when
    ``grads``), modules deep-copied, other values as they are."""
    if isinstance(value, torch.Tensor):
        copy_ = value.detach().clone()
        if value.requires_grad or (grads and (copy_.is_floating_point() or copy_.is_complex())):
            copy_.requires_grad_(True)
        return copy_
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value)
    if isinstance(value, Mapping):
        return {key: fresh(item, grads) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fresh(item, grads) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(fresh(item, grads) for item in value)
    return value


@contextlib.contextmanager
def seeded(seed: int):
    """Every run starts from the same torch, Python and NumPy RNG state; restored after."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


@contextlib.contextmanager
def thread_count(count: int | None):
    if count is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# -- contention ---------------------------------------------------------------------------

class Contention:
    """A background workload competing with the code under test for the hardware: a thread of
    matrix products (they release the GIL and take the intra-op pool's cores), queued on a side
    CUDA stream of each device the inputs use on a GPU (as overlapped communication does)."""

    def __init__(self, devices: Iterable[torch.device] = ()):
        self.cuda_devices = sorted({d.index or 0 for d in devices if d.type == "cuda"})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.iterations = 0

    def __enter__(self) -> "Contention":
        self._thread = threading.Thread(target=self._work, name="samebits-contention", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _work(self) -> None:
        gen = torch.Generator().manual_seed(1)
        a = torch.randn(192, 192, generator=gen)
        gpu = []
        for index in self.cuda_devices:  # pragma: no cover - needs a GPU
            device = torch.device("cuda", index)
            stream = torch.cuda.Stream(device=device)
            m = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
            gpu.append((device, stream, m))
        while not self._stop.is_set():
            for device, stream, m in gpu:  # pragma: no cover - needs a GPU
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    for _ in range(4):
                        m = m @ m
                        m = m / m.abs().amax().clamp_min(1)
            a = torch.mm(a, a)
            a = a / a.abs().max().clamp_min(1.0)
            self.iterations += 1
        for device, stream, _ in gpu:  # pragma: no cover - needs a GPU
            stream.synchronize()


def _devices(value: Any) -> set[torch.device]:
    found = set()
    for _, obj in _walk(value, ""):
        if isinstance(obj, torch.Tensor):
            found.add(obj.device)
        else:
            found.update(p.device for p in obj.parameters())
    return found


# -- the public checks --------------------------------------------------------------------

DEFAULTS = _options.SESSION_DEFAULTS  # runs / contention left as None (pytest --samebits-runs, ...)


def _check_threads(threads) -> list[int | None]:
    if threads is None:
        return [None]
    counts = [threads] if isinstance(threads, int) else list(threads)
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ConfigError(f"threads={threads!r}: give a thread count or a list of them (each >= 1), "
                          "e.g. threads=[1, 2].")
    return counts


def _check_runs(runs, minimum: int, what: str) -> int:
    if not isinstance(runs, int) or isinstance(runs, bool) or runs < minimum:
        raise ConfigError(f"runs={runs!r}: {what} needs an integer >= {minimum}.")
    return runs


def repeat(produce: Callable[[], tuple[Any, Any]], *, name: str, runs: int, grads: bool,
           threads, contention: bool, seed: int = 0, devices: Iterable[torch.device] = (),
           stop_at_first_difference: bool = False) -> BitwiseReport:
    """Run ``produce`` ``runs`` times at each thread count and compare every run with the first."""
    counts = _check_threads(threads)
    configs = [{"threads": count if count is not None else torch.get_num_threads(),
                "contention": bool(contention)} for count in counts for _ in range(runs)]
    first: list[Leaf] | None = None
    report = BitwiseReport(name, configs, [], 0, [], [], {})
    load = Contention(devices) if contention else contextlib.nullcontext()
    with load:
        for index, (config, count) in enumerate(zip(configs, [c for c in counts for _ in range(runs)])):
            with thread_count(count), seeded(seed):
                result, sources = produce()
                leaves, num_gradients = collect(result, grads=grads, grad_sources=sources)
            if first is None:
                first, report.paths, report.num_gradients = leaves, [leaf.path for leaf in leaves], num_gradients
                continue
            mismatches = compare(first, leaves)
            if mismatches:
                report.differing_runs.append(index)
                if not report.mismatches:
                    report.mismatches = mismatches
                for mismatch in mismatches:
                    report.counts[mismatch.path] = report.counts.get(mismatch.path, 0) + 1
                if stop_at_first_difference:
                    report.runs = configs[: index + 1]
                    break
    return report


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _producer(fn: Callable, inputs: tuple, grads: bool) -> Callable[[], tuple[Any, Any]]:
    def produce():
        call = fresh(fn, grads) if isinstance(fn, torch.nn.Module) else fn
        args = fresh(inputs, grads)
        result = call(*args)
        if isinstance(call, torch.nn.Module):  # its parameters' gradients and buffers too
            return (result, call) if result is not None else call, args
        return result, args
    return produce


def assert_bitwise_repeatable(fn: Callable, *inputs: Any, runs: int | None = None, grads: bool = True,
                              threads: int | Iterable[int] | None = None, contention: bool | None = None,
                              seed: int = 0) -> BitwiseReport:
    """Run ``fn(*inputs)`` ``runs`` times (at each of ``threads``) on fresh copies of the inputs,
    each from the same RNG state (``seed``), and assert that every output and gradient (of the
    inputs; of a module's parameters, deep-copied per run, with its parameters and buffers) is
    bitwise equal.  ``runs`` and ``contention`` None take the session's defaults (pytest
    ``--samebits-runs`` / ``--samebits-contention``).  docs/testing.md has the rest.
    """
    runs = _check_runs(DEFAULTS["runs"] if runs is None else runs, 2, "a repeatability check")
    contention = DEFAULTS["contention"] if contention is None else contention
    report = repeat(_producer(fn, inputs, grads), name=_name_of(fn), runs=runs, grads=grads,
                    threads=threads, contention=contention, seed=seed, devices=_devices((fn, inputs)))
    for observer in _options.observers:
        observer(report)
    if not report.ok:
        raise AssertionError(report.message())
    return report


def expect_nondeterministic(fn: Callable, *inputs: Any, runs: int = 10, grads: bool = True,
                            threads: int | Iterable[int] | None = None, contention: bool | None = None,
                            seed: int = 0) -> BitwiseReport:
    """A negative control: pass only if two of ``runs`` runs of ``fn`` differ, so a harness,
    thread setting or machine that cannot show the race is caught instead of passing silently."""
    _check_runs(runs, 2, "a negative control")
    contention = DEFAULTS["contention"] if contention is None else contention
    report = repeat(_producer(fn, inputs, grads), name=_name_of(fn), runs=runs, grads=grads,
                    threads=threads, contention=contention, seed=seed, devices=_devices((fn, inputs)),
                    stop_at_first_difference=True)
    if report.ok:
        notes = []
        if torch.are_deterministic_algorithms_enabled():
            notes.append("torch.use_deterministic_algorithms is on, which makes most racy ops deterministic")
        counts = sorted({run["threads"] for run in report.runs})
        if counts == [1]:
            notes.append("it ran with 1 thread only: CPU races need >= 2 (threads=2)")
        raise AssertionError(
            f"negative control {report.name}: expected runs to differ, but all {len(report.runs)} runs "
            f"(threads {counts}) gave the same bits in {len(report.paths)} values. Either this path is "
            "deterministic here or the harness cannot see the race" + (": " + "; ".join(notes) if notes else
                                                                       " (a busy or single-core machine?)"))
    return report


def assert_same_bits(a: Any, b: Any, *, names: tuple[str, str] = ("a", "b")) -> None:
    """Assert two (nested structures of) tensors are bitwise equal; strides are ignored."""
    mismatches = compare(flatten(_without_modules(a), "value"), flatten(_without_modules(b), "value"))
    if mismatches:
        raise AssertionError(render(mismatches, header=f"{names[0]} and {names[1]} differ in "
                                                        f"{len(mismatches)} value(s) ({names[0]} vs {names[1]}):"))


# -- the shipped negative control ---------------------------------------------------------

def index_put_accumulate_control(rows: int = 8, num_indices: int = 65536, width: int = 64,
                                 seed: int = 0) -> tuple[Callable, tuple]:
    """The CPU race as (fn, inputs): ``zeros(rows, width).index_put_((idx,), values,
    accumulate=True)`` with many indices colliding on few rows.  ATen splits the indices
    between threads once there are more than 32768 elements, and with >= 2 threads the
    colliding rows are summed in arrival order.  Measured on 2 busy cores: 65536 indices gave
    19-20 distinct results in 20 calls, 8192 only 3-8 (a shorter parallel region overlaps less)."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (num_indices,), generator=gen)
    values = torch.randn(num_indices, width, generator=gen)

    def index_put_accumulate(index, values):
        return torch.zeros(rows, width, dtype=values.dtype).index_put_((index,), values, accumulate=True)

    return index_put_accumulate, (index, values)


def check_negative_control(runs: int = 20, threads: int = 2) -> BitwiseReport:
    """Show that this harness catches the CPU ``index_put_(accumulate=True)`` race here."""
    fn, inputs = index_put_accumulate_control()
    return expect_nondeterministic(fn, *inputs, runs=runs, grads=False, threads=threads)
