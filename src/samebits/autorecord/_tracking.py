"""Training state a process creates, seen from its creation: what the census needs.

Zero-code recording cannot wait for an optimizer's first ``step()`` to learn of it: a resumed
process whose ``load_state_dict`` was forgotten would then have no optimizer in its census at
the resume step, and a missing record names nothing.  `install_tracking` wraps the
constructors of every kind of training state, once per process:

* ``torch.optim.Optimizer``, ``LRScheduler`` and ``torch.amp.GradScaler`` (their ``__init__``);
* ``torch.Generator`` (replaced by a subclass that notes where each one was made) and
  ``numpy.random.default_rng``: generators are named by creation site (``train.py:30``);
* ``torch.utils.data.DataLoader`` (its creation site, its iterators and their position).

It also keeps a short log of *events* on the global generators: each one's state as the
process starts (``initial``), a restore or a seed
(``torch.set_rng_state``, ``torch.manual_seed``, ``random.setstate``, ``np.random.set_state``,
...) with the digest of the state it set, and a draw by a data loader's iterator (creating it
draws a base seed; its first batch draws the sampler's seed).  The verify explanation reads
them to say "restored at train.py:58, then drawn from by the DataLoader iterator made at
train.py:70".  Objects are held weakly: tracking keeps nothing alive.
"""

from __future__ import annotations

import functools
import os
import random
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samebits._torchutil import SAMEBITS_DIR, call_site, outside_dispatch_modes
from samebits.checkpoint import global_rng_record
from samebits.fingerprint import digest

try:
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

MAX_EVENTS = 10_000  # a program that reseeds every step keeps its first events only


class _Live:
    """Objects in creation order, held weakly."""

    def __init__(self):
        self._refs: list[tuple[weakref.ref, str | None]] = []

    def add(self, obj: Any, site: str | None = None) -> None:
        try:
            self._refs.append((weakref.ref(obj), site))
        except TypeError:  # not weak-referenceable: not tracked
            pass

    def alive(self) -> list[tuple[Any, str | None]]:
        out, keep = [], []
        for ref, site in self._refs:
            obj = ref()
            if obj is not None:
                out.append((obj, site))
                keep.append((ref, site))
        self._refs = keep
        return out


class _DrawWatch(TorchDispatchMode):
    """Between a restore of the torch CPU generator and the first step: the first op that draws
    from the global generator (an op tagged ``nondeterministic_seeded``, no generator of its
    own, on the CPU), logged as a draw with the user's line that made it."""

    def __init__(self, tracking: "Tracking"):
        super().__init__()
        self.tracking = tracking
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.seen and _draws_from_the_global_generator(func, args, kwargs):
            self.seen = True
            self.tracking.event("torch_cpu", "drawn", _site(), by=f"{func.name()} (a draw from the global generator)")
        return func(*args, **kwargs)


def _draws_from_the_global_generator(func, args, kwargs) -> bool:
    try:
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        return all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
    except Exception:  # noqa: BLE001 - watching must never break the program
        return False


class Tracking:
    """What this process made (alive now) and the events on its global generators."""

    def __init__(self, step: Callable[[], int]):
        self.step = step  # the step the program is in (the next optimizer step)
        self.watch_draws = True  # off under the tracer (its own dispatch modes come and go)
        self.begun = False  # the program's first step has begun
        self._watch: _DrawWatch | None = None
        self.optimizers = _Live()
        self.schedulers = _Live()
        self.scalers = _Live()
        self.generators = _Live()
        self.loaders = _Live()
        self.events: list[dict] = []
        self.written = 0  # events already handed to `new_events`

    # --- what the census reads ---------------------------------------------------------
    def named_generators(self) -> dict[str, Any]:
        """Every live generator the program made, named by creation site (``#2`` for the
        second alive one made at the same line)."""
        named: dict[str, Any] = {}
        for generator, site in self.generators.alive():
            name = site or "unknown"
            number = 1
            while name in named:
                number += 1
                name = f"{site or 'unknown'}#{number}"
            named[name] = generator
        return named

    def loader_positions(self) -> list[tuple[str, torch.Tensor]]:
        """``data.<site>``: int64[1], the batches its newest iterator yielded (-1: none yet), for
        each live DataLoader: the position in the epoch, which a resume must restore (how many
        iterators a process made is its own history, not state)."""
        records, seen = [], set()
        for loader, site in self.loaders.alive():
            name = f"data.{site or 'unknown'}"
            number = 1
            while name in seen:
                number += 1
                name = f"data.{site or 'unknown'}#{number}"
            seen.add(name)
            state = loader.__dict__.get("_samebits_position", [None, 0])
            iterator = state[0]() if state[0] is not None else None
            yielded = int(getattr(iterator, "_num_yielded", -1)) if iterator is not None else -1
            records.append((name, torch.tensor([yielded], dtype=torch.int64)))
        return records

    def watch_draws_after_restore(self) -> None:
        """The torch CPU generator was restored before the first step: log the first draw from
        it until the step begins (`begin`)."""
        if self.watch_draws and not self.begun and self._watch is None:
            watch = _DrawWatch(self)
            watch.__enter__()
            self._watch = watch

    def begin(self) -> None:
        """The program's first step began: stop watching for draws."""
        self.begun = True
        watch, self._watch = self._watch, None
        if watch is not None:
            try:
                watch.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - another mode pushed above it: it ends with the process
                pass

    def new_events(self) -> list[dict]:
        events = self.events[self.written:]
        self.written = len(self.events)
        return events

    # --- events --------------------------------------------------------------------------
    def event(self, generator: str, what: str, site: str | None, **extra) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append({"step": self.step(), "generator": generator, "event": what,
                                "site": site, **extra})


def _site() -> str | None:
    """The user's ``file:line`` that made the call (torch's and samebits' own frames skipped),
    the file as its base name."""
    site = call_site(2, skip=("<", SAMEBITS_DIR, _NUMPY_DIR), with_function=False)
    if site is None:
        return None
    path, _, line = site.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def _in_a_library() -> bool:
    """Whether the caller (past torch's and samebits' frames) is an installed library's code
    (site-packages), not the program's own: e.g. Lightning's `isolate_rng` restoring a state
    it saved itself a moment before."""
    site = call_site(2, skip=("<", SAMEBITS_DIR, _NUMPY_DIR), with_function=False) or ""
    return any(part in site for part in ("site-packages", "dist-packages"))


_NUMPY_DIR = os.path.dirname(_np.__file__) if _np is not None else "\0"


def _wrap_init(cls, on_made: Callable[[Any], None]) -> None:
    original = cls.__init__
    if getattr(original, "_samebits_tracking", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        on_made(self)

    __init__._samebits_tracking = True
    cls.__init__ = __init__


def _torch_state_digest() -> int:
    return digest(torch.get_rng_state())


def install_tracking(tracking: Tracking) -> None:
    """Wrap the constructors and the global generators' restore/seed functions (once)."""
    _wrap_init(torch.optim.Optimizer, tracking.optimizers.add)
    _wrap_init(torch.optim.lr_scheduler.LRScheduler, tracking.schedulers.add)
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        _wrap_init(scaler, tracking.scalers.add)
    _track_generators(tracking)
    _track_loaders(tracking)
    _track_restores(tracking)
    for generator in ("python", "numpy", "torch_cpu"):  # as the program finds them, before its own code
        try:
            with outside_dispatch_modes():
                state = digest(global_rng_record(generator))
        except Exception:  # noqa: BLE001 - (numpy missing) no initial state to compare with
            continue
        tracking.event(generator, "initial", None, digest=f"{state:016x}")


def _track_generators(tracking: Tracking) -> None:
    base = torch.Generator
    if getattr(base, "_samebits_tracking", False):
        return

    class Generator(base):  # torch.Generator, noting where each is made
        _samebits_tracking = True

        def __init__(self, *args, **kwargs):
            tracking.generators.add(self, _site())

    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    Generator.__doc__ = base.__doc__
    torch.Generator = Generator
    if _np is not None and not getattr(_np.random.default_rng, "_samebits_tracking", False):
        original = _np.random.default_rng

        @functools.wraps(original)
        def default_rng(*args, **kwargs):
            generator = original(*args, **kwargs)
            tracking.generators.add(generator, _site())
            return generator

        default_rng._samebits_tracking = True
        _np.random.default_rng = default_rng


def _track_loaders(tracking: Tracking) -> None:
    from torch.utils.data import DataLoader  # noqa: PLC0415 - torch's, loaded with torch.utils.data
    from torch.utils.data.dataloader import _BaseDataLoaderIter  # noqa: PLC0415

    if getattr(DataLoader.__iter__, "_samebits_tracking", False):
        return

    def made(loader):
        loader.__dict__["_samebits_position"] = [None, 0]
        tracking.loaders.add(loader, _site())

    _wrap_init(DataLoader, made)
    original_iter, original_next = DataLoader.__iter__, _BaseDataLoaderIter.__next__

    @functools.wraps(original_iter)
    def __iter__(self):
        with outside_dispatch_modes():
            before = torch.get_rng_state()
        iterator = original_iter(self)
        state = self.__dict__.setdefault("_samebits_position", [None, 0])
        if state[0] is None or state[0]() is not iterator:
            state[1] += 1
        try:
            state[0] = weakref.ref(iterator)
        except TypeError:
            state[0] = None
        if _advanced(before):
            tracking.event("torch_cpu", "drawn", _site(), by="the DataLoader iterator made here")
        return iterator

    @functools.wraps(original_next)
    def __next__(self):
        if self.__dict__.get("_samebits_first_done"):
            return original_next(self)
        self.__dict__["_samebits_first_done"] = True
        with outside_dispatch_modes():
            before = torch.get_rng_state()
        batch = original_next(self)
        if _advanced(before):
            tracking.event("torch_cpu", "drawn", _site(),
                           by="the first batch of a DataLoader iterator (its sampler's shuffle seed)")
        return batch

    __iter__._samebits_tracking = True
    DataLoader.__iter__ = __iter__
    _BaseDataLoaderIter.__next__ = __next__


def _advanced(before: torch.Tensor) -> bool:
    """True if the torch CPU generator moved since its state was ``before``."""
    with outside_dispatch_modes():
        return not torch.equal(before, torch.get_rng_state())


def _track_restores(tracking: Tracking) -> None:
    """Restores and seeds of the global generators, each with the digest of the state set."""

    def wrap(owner, attribute: str, generator: str, what: str) -> None:
        original = getattr(owner, attribute, None)
        if original is None or getattr(original, "_samebits_tracking", False):
            return

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            try:
                with outside_dispatch_modes():
                    state = digest(global_rng_record(generator))
            except Exception:  # noqa: BLE001 - an event must never break the program
                state = None
            tracking.event(generator, what, _site(), digest=None if state is None else f"{state:016x}",
                           call=f"{getattr(owner, '__name__', '')}.{attribute}", library=_in_a_library())
            if generator == "torch_cpu" and what == "restored":
                tracking.watch_draws_after_restore()
            return result

        wrapper._samebits_tracking = True
        setattr(owner, attribute, wrapper)

    import torch.random as torch_random  # noqa: PLC0415 - torch's own module

    for owner in (torch, torch_random):
        wrap(owner, "set_rng_state", "torch_cpu", "restored")
        wrap(owner, "manual_seed", "torch_cpu", "seeded")
        wrap(owner, "seed", "torch_cpu", "seeded")
    wrap(random, "setstate", "python", "restored")
    wrap(random, "seed", "python", "seeded")
    if _np is not None:
        wrap(_np.random, "set_state", "numpy", "restored")
        wrap(_np.random, "seed", "numpy", "seeded")
