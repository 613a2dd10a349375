"""Training state a process creates, seen from its creation: what the census needs.

The census cannot wait for an optimizer's first ``step()``: a resumed process that forgot a
``load_state_dict`` would have no optimizer in its census at the resume step.  `install_tracking`
watches the construction of optimizers, LR schedulers, GradScalers, torch and NumPy generators
(named by creation site, ``train.py:30``) and every DataLoader and its iterators (the position
in the epoch), and logs *events* on the global generators (initial state, restores, seeds, draws
by a loader's iterator) for verify's explanation.

The program must not be able to tell (issue 33): ``torch.Generator`` stays torch's class, nothing
is stored on the program's objects (all is here, keyed by ``id``, held weakly where possible), and
every wrapper calls the original outside `guard`, so samebits' failures become gaps and the
program's exceptions and results pass through unchanged.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import os
import random
import sys
import weakref
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from samebits._torchutil import SAMEBITS_DIR, call_site, outside_dispatch_modes
from samebits.stream.gaps import guard
from samebits.checkpoint import CensusName, global_rng_record
from samebits.fingerprint import digest

try:
    import numpy as _np
except ImportError:  # pragma: no cover
    _np = None

MAX_EVENTS = 10_000  # a program that reseeds every step keeps its first events only
MAX_HELD = 64  # generators made in one step and held to its census: a per-sample generator keeps the newest
_TRACKED = "_samebits_tracking"  # marks samebits' own wrappers (on the wrapper, never on the program's objects)


class _Held:
    """A strong ``weakref.ref`` stand-in for NumPy's ``Generator``; `_Live.prune` lets it go."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class _Live:
    """Objects in creation order, held weakly, with their site and notes kept here, not on the
    object (``vars``, pickling and ``deepcopy`` see nothing); keyed by ``id`` (a class may define
    ``__eq__``).  ``strong=True`` holds the unweakreferenceable until `prune`."""

    def __init__(self, strong: bool = False):
        self._entries: dict[int, tuple[weakref.ref | _Held, str | None, dict]] = {}
        self._strong = strong

    def prune(self) -> None:
        """Let go of strongly held objects the program no longer holds (at most `MAX_HELD` kept)."""
        held = [key for key, (ref, _, _) in self._entries.items() if isinstance(ref, _Held)]
        for number, key in enumerate(held):
            ref = self._entries[key][0]
            # two references when only tracking holds it: ``ref.obj`` and getrefcount's argument
            if number < len(held) - MAX_HELD or sys.getrefcount(ref.obj) <= 2:
                del self._entries[key]

    def add(self, obj: Any, site: str | None = None) -> dict | None:
        """Track ``obj`` (once); its notes, or None if it cannot be held weakly."""
        notes = self.notes(obj)
        if notes is not None:
            return notes
        key = id(obj)
        entries = self._entries

        def gone(ref, key=key):  # its id may be reused: drop only its own entry
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        try:
            ref = weakref.ref(obj, gone)
        except TypeError:  # not weak-referenceable: held until the program lets it go, or not tracked
            if not self._strong:
                return None
            ref = _Held(obj)
            if sum(isinstance(entry[0], _Held) for entry in self._entries.values()) >= MAX_HELD:
                self.prune()  # a process that never ends a step (a data worker) keeps few
        notes = {}
        entries.pop(key, None)  # a dead one's id, reused: the new object goes last, in creation order
        entries[key] = (ref, site, notes)
        return notes

    def notes(self, obj: Any) -> dict | None:
        """What tracking noted about ``obj``; None if it is not tracked."""
        entry = self._entries.get(id(obj))
        if entry is None or entry[0]() is not obj:
            return None
        return entry[2]

    def alive(self) -> list[tuple[Any, str | None]]:
        return [(obj, site) for ref, site, _ in list(self._entries.values()) if (obj := ref()) is not None]


class _DrawWatch(TorchDispatchMode):
    """Logs the first draw from the global generator between its restore and the first step."""

    def __init__(self, tracking: "Tracking"):
        super().__init__()
        self.tracking = tracking
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.seen:
            with guard("tracking.draw_watch", step=self.tracking.step(), records="events"):
                if _draws_from_the_global_generator(func, args, kwargs):
                    self.seen = True
                    self.tracking.event("torch_cpu", "drawn", _site(),
                                        by=f"{func.name()} (a draw from the global generator)")
        return func(*args, **kwargs)


def _draws_from_the_global_generator(func, args, kwargs) -> bool:
    try:
        if torch.Tag.nondeterministic_seeded not in func.tags or kwargs.get("generator") is not None:
            return False
        device = kwargs.get("device")
        if device is not None and torch.device(device).type != "cpu":
            return False
        return all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
    except Exception:  # noqa: BLE001 - an op without tags or a device torch cannot name: not a draw we know
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
        self.generators = _Live(strong=True)  # NumPy's generators cannot be held weakly
        self.loaders = _Live()  # notes: "iterator", a weakref to its newest iterator
        self.iterators = _Live()  # data-loader iterators; notes: "first_done"
        self.events: list[dict] = []
        self.written = 0  # events already handed to `new_events`
        # Generators made since the step began, held until its census has read them: one made,
        # used and dropped between two censuses (a dataset's clock-seeded reshuffle) is otherwise
        # never seen.  Only its lifetime changes, by at most a step (no observable finaliser).
        self.held: list[Any] = []

    # --- what the census reads ---------------------------------------------------------
    def named_generators(self) -> dict[str, Any]:
        """Every live generator the program made, by creation site (``#2``: the second from one line)."""
        named: dict[str, Any] = {}
        for generator, site in self.generators.alive():
            named[_numbered(site, named)] = generator
        return named

    def census_records(self) -> list[tuple[str, torch.Tensor]]:
        """The census records of tracked state `state_census`'s arguments do not cover, so a new
        kind of tracked state needs no other change (docs/architecture.md).  Today each live
        DataLoader's position in the epoch, ``data.<site>``: the batches its newest iterator
        yielded (-1: none yet), and a stateful loader's ``state_dict`` digest."""
        records, seen = [], set()
        for loader, site in self.loaders.alive():
            numbered = _numbered(site, seen)
            seen.add(numbered)
            name = str(CensusName.loader(numbered))
            ref = (self.loaders.notes(loader) or {}).get("iterator")
            iterator = ref() if ref is not None else None
            yielded = int(getattr(iterator, "_num_yielded", -1)) if iterator is not None else -1
            records.append((name, torch.tensor([yielded], dtype=torch.int64)))
            # A stateful loader saves more than the count (its dataset's position: torchtitan's
            # sample_idx).  Its state_dict makes an iterator if it has none (drawing the epoch's
            # shuffle), so it is asked only once the program has iterated it.
            made = getattr(loader, "_iterator", iterator)
            if callable(getattr(type(loader), "state_dict", None)) and made is not None:
                with guard("tracking.dataloader_state", step=self.step(), records=f"{name}'s state_dict"):
                    records.append((str(CensusName.parse(name).loader_state()),
                                    torch.tensor(list(_state_digest(loader.state_dict())), dtype=torch.uint8)))
        return records

    def watch_draws_after_restore(self) -> None:
        """The torch CPU generator was restored before the first step: log its first draw."""
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

    def hold(self, generator: Any) -> None:
        """Keep ``generator``, made during a step, alive until the step's census is written."""
        if self.begun:
            self.held.append(generator)
            del self.held[:-MAX_HELD]

    def release(self) -> None:
        """The step's census read the generators: the program's own references decide again."""
        self.held.clear()
        self.generators.prune()

    def new_events(self) -> list[dict]:
        events = self.events[self.written:]
        self.written = len(self.events)
        return events

    # --- events --------------------------------------------------------------------------
    def event(self, generator: str, what: str, site: str | None, **extra) -> None:
        if len(self.events) < MAX_EVENTS:
            self.events.append({"step": self.step(), "generator": generator, "event": what,
                                "site": site, **extra})


def _numbered(site: str | None, taken) -> str:
    """``site`` (or "unknown"), with ``#N`` for the N-th of ``taken`` made at that line."""
    name, number = site or "unknown", 1
    while name in taken:
        number += 1
        name = f"{site or 'unknown'}#{number}"
    return name


def _package_dir(name: str) -> str | None:

    """The folder of package ``name`` if the program has imported it (never imports it)."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return os.path.dirname(path) if path else None


#: Frames that are never the user's line (besides torch's): samebits', NumPy's, generated code,
#: and ``copy``'s (a ``deepcopy`` of a generator is sited at the line that copied).
_NUMPY_DIR = os.path.dirname(_np.__file__) if _np is not None else "\0"
_SKIPPED = ("<", SAMEBITS_DIR, _NUMPY_DIR, copy.__file__, copyreg.__file__)


def _skipped() -> tuple[str, ...]:
    torchdata = _package_dir("torchdata")  # a stateful loader's own frames, as torch's are
    return _SKIPPED + (torchdata,) if torchdata else _SKIPPED


def _state_digest(value: Any) -> bytes:
    """SHA-256 of a state dict's exact contents, for the census.  A generator's state inside it
    (torchdata's sampler's ``generator``) is left out: the generator has its own census record,
    so a wrong generator is a generator finding, not a data position."""
    import hashlib  # noqa: PLC0415 - only stateful loaders need it
    import struct  # noqa: PLC0415

    hasher = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, dict):
            hasher.update(b"d%d" % len(item))
            for key in sorted(item, key=str):
                value = item[key]
                if key == "generator" and isinstance(value, torch.Tensor) and value.dtype == torch.uint8:
                    continue
                feed(str(key))
                feed(value)
        elif isinstance(item, (list, tuple)):
            hasher.update(b"l%d" % len(item))
            for element in item:
                feed(element)
        elif isinstance(item, bool) or item is None:
            hasher.update(b"b" + repr(item).encode())
        elif isinstance(item, int):
            hasher.update(b"i" + str(item).encode() + b";")
        elif isinstance(item, float):
            hasher.update(b"f" + struct.pack("<d", item))
        elif isinstance(item, (str, bytes)):
            data = item.encode() if isinstance(item, str) else item
            hasher.update(b"s%d:" % len(data) + data)
        elif isinstance(item, torch.Tensor):
            with outside_dispatch_modes():
                local = item.detach().to_local() if hasattr(item, "to_local") else item.detach()
                data = local.cpu().contiguous().view(torch.uint8).numpy().tobytes() if local.numel() else b""
            hasher.update(f"t{local.dtype}{tuple(local.shape)}:".encode() + data)
        elif hasattr(item, "dtype") and hasattr(item, "tobytes"):  # a NumPy array or scalar
            hasher.update(f"a{item.dtype}{getattr(item, 'shape', ())}:".encode() + item.tobytes())
        else:
            hasher.update(b"r" + repr(item).encode())

    feed(value)
    return hasher.digest()


def _site() -> str | None:
    """The user's ``file:line`` (base name) that made the call."""
    site = call_site(2, skip=_skipped(), with_function=False)
    if site is None:
        return None
    path, _, line = site.rpartition(":")
    return f"{os.path.basename(path)}:{line}"


def _in_a_library() -> bool:
    """Whether the caller is an installed library (site-packages), e.g. Lightning's `isolate_rng`."""
    site = call_site(2, skip=_skipped(), with_function=False) or ""
    return any(part in site for part in ("site-packages", "dist-packages"))


def _wrap_init(cls, on_made: Callable[[Any], None], what: str) -> None:
    """``cls.__init__`` calls ``on_made(self)`` after the original returned (inside `guard`)."""
    original = cls.__init__
    if getattr(original, _TRACKED, False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        with guard(f"tracking.{what}", records=f"the {what}'s creation"):
            on_made(self)

    setattr(__init__, _TRACKED, True)
    cls.__init__ = __init__


def install_tracking(tracking: Tracking) -> None:
    """Watch the constructors and the global generators' restore/seed functions (once)."""
    with guard("tracking.install", records="training state tracking"):
        _install(tracking)


def _install(tracking: Tracking) -> None:
    _wrap_init(torch.optim.Optimizer, lambda made: tracking.optimizers.add(made), "optimizer")
    _wrap_init(torch.optim.lr_scheduler.LRScheduler, lambda made: tracking.schedulers.add(made), "scheduler")
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if scaler is not None:
        _wrap_init(scaler, lambda made: tracking.scalers.add(made), "scaler")
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


# --- generators ----------------------------------------------------------------------------

def _track_generators(tracking: Tracking) -> None:
    def made(generator) -> None:
        with guard("tracking.generator", records="a generator's creation site"):
            tracking.generators.add(generator, _site())
            tracking.hold(generator)

    base = torch._C.Generator
    meta = type(base)
    if meta is not type:
        _watch_generator_calls(meta, base, made)
    elif torch.Generator is base:  # an older torch: its metaclass is ``type``, which cannot be changed
        torch.Generator = _generator_factory(base, made)
    if _np is not None:
        _track_default_rng(made)


def _watch_generator_calls(meta: type, base: type, made: Callable[[Any], None]) -> None:
    """torch >= 2.13: ``torch.Generator``'s Python metaclass ``__call__`` sees every generator
    made (subclasses and unpickled copies too), while ``torch.Generator`` stays torch's own class
    (``type(g)``, isinstance, pickling, ``torch.compile`` unchanged)."""
    original = meta.__call__  # type.__call__ unless torch gives the metaclass its own
    if getattr(original, _TRACKED, False):
        return

    def __call__(cls, *args, **kwargs):
        obj = original(cls, *args, **kwargs)
        if isinstance(obj, base):
            made(obj)
        return obj

    __call__.__doc__ = original.__doc__
    setattr(__call__, _TRACKED, True)
    meta.__call__ = __call__


def _generator_factory(base: type, made: Callable[[Any], None]) -> type:
    """torch < 2.13: ``torch.Generator`` becomes a stand-in that returns a genuine
    ``torch._C.Generator`` (noted) and that every generator is an instance of; only
    ``type(g) is torch.Generator`` is False there."""

    class _GeneratorType(type(base)):
        def __instancecheck__(cls, instance):
            return isinstance(instance, base) if cls is factory else super().__instancecheck__(instance)

        def __subclasscheck__(cls, subclass):
            return issubclass(subclass, base) if cls is factory else super().__subclasscheck__(subclass)

    class Generator(base, metaclass=_GeneratorType):
        def __new__(cls, *args, **kwargs):
            generator = base(*args, **kwargs) if cls is factory else base.__new__(cls, *args, **kwargs)
            made(generator)
            return generator

    factory = Generator
    Generator.__module__, Generator.__qualname__ = "torch", "Generator"
    Generator.__doc__ = base.__doc__
    setattr(Generator, _TRACKED, True)
    return Generator


def _track_default_rng(made: Callable[[Any], None]) -> None:
    """``numpy.random.default_rng`` notes each generator it makes (replaced where NumPy defines it)."""
    original = _np.random.default_rng
    if getattr(original, _TRACKED, False):
        return

    @functools.wraps(original)
    def default_rng(*args, **kwargs):
        generator = original(*args, **kwargs)
        made(generator)
        return generator

    setattr(default_rng, _TRACKED, True)
    _replace(_np.random, "default_rng", original, default_rng)


# --- data loaders --------------------------------------------------------------------------

def _track_loaders(tracking: Tracking) -> None:
    """A DataLoader of any class is noted in ``DataLoader.__new__`` (subclasses need not call
    ``__init__``; the site is the line that made it); each iterator becomes its loader's newest
    in ``_BaseDataLoaderIter.__init__`` (before a stateful one restores its position)."""
    from torch.utils.data import DataLoader  # noqa: PLC0415 - torch's, loaded with torch.utils.data
    from torch.utils.data.dataloader import _BaseDataLoaderIter  # noqa: PLC0415

    if getattr(DataLoader.__dict__.get("__new__"), _TRACKED, False):
        return
    original_new = DataLoader.__new__
    original_init, original_next = _BaseDataLoaderIter.__init__, _BaseDataLoaderIter.__next__
    plain_new = original_new is object.__new__

    def __new__(cls, *args, **kwargs):
        # object.__new__ takes the class alone once a class defines __new__
        loader = original_new(cls) if plain_new else original_new(cls, *args, **kwargs)
        with guard("tracking.dataloader", records="a data loader's creation site"):
            tracking.loaders.add(loader, _site())
        return loader

    @functools.wraps(original_init)
    def __init__(self, loader, *args, **kwargs):
        before = None
        with guard("tracking.dataloader_iter", records="a data loader's position"):
            with outside_dispatch_modes():
                before = torch.get_rng_state()
        original_init(self, loader, *args, **kwargs)
        with guard("tracking.dataloader_iter", records="a data loader's position"):
            notes = tracking.loaders.add(loader, _site())  # made before tracking began: named by its first use
            tracking.iterators.add(self)
            if notes is not None:
                notes["iterator"] = weakref.ref(self)
            if before is not None and _advanced(before):
                tracking.event("torch_cpu", "drawn", _site(), by="the DataLoader iterator made here")

    @functools.wraps(original_next)
    def __next__(self):
        before = None
        with guard("tracking.dataloader_next", records="a data loader's first draw"):
            notes = tracking.iterators.notes(self)
            if notes is not None and not notes.get("first_done"):
                notes["first_done"] = True
                with outside_dispatch_modes():
                    before = torch.get_rng_state()
        batch = original_next(self)
        if before is not None:
            with guard("tracking.dataloader_next", records="a data loader's first draw"):
                if _advanced(before):
                    tracking.event("torch_cpu", "drawn", _site(),
                                   by="the first batch of a DataLoader iterator (its sampler's shuffle seed)")
        return batch

    for wrapper in (__new__, __init__, __next__):
        setattr(wrapper, _TRACKED, True)
    __new__.__doc__ = original_new.__doc__
    DataLoader.__new__ = __new__
    _BaseDataLoaderIter.__init__ = __init__
    _BaseDataLoaderIter.__next__ = __next__


def _advanced(before: torch.Tensor) -> bool:
    """True if the torch CPU generator moved since its state was ``before``."""
    with outside_dispatch_modes():
        return not torch.equal(before, torch.get_rng_state())


# --- restores and seeds of the global generators -------------------------------------------

def _track_restores(tracking: Tracking) -> None:
    """Restores and seeds of the global generators, each with the digest of the state set."""

    def wrap(owner, attribute: str, generator: str, what: str) -> None:
        original = getattr(owner, attribute, None)
        if original is None or getattr(original, _TRACKED, False):
            return

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            result = original(*args, **kwargs)
            with guard(f"tracking.{what}", records=f"a {generator} generator event"):
                try:
                    with outside_dispatch_modes():
                        state = digest(global_rng_record(generator))
                except Exception:  # noqa: BLE001 - the event without its digest
                    state = None
                tracking.event(generator, what, _site(), digest=None if state is None else f"{state:016x}",
                               call=f"{getattr(owner, '__name__', '')}.{attribute}", library=_in_a_library())
                if generator == "torch_cpu" and what == "restored":
                    tracking.watch_draws_after_restore()
            return result

        setattr(wrapper, _TRACKED, True)
        _replace(owner, attribute, original, wrapper)

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


def _replace(owner, attribute: str, original: Any, wrapper: Callable) -> None:
    """Put ``wrapper`` in ``original``'s place as ``owner.attribute`` and under the original's
    own name (``torch.random.manual_seed``), so pickling by name finds it; a bound method
    (``random.seed``) is named after its attribute."""
    home = sys.modules.get(getattr(original, "__module__", None) or "")
    name = getattr(original, "__qualname__", None) or ""
    if home is not None and home is not owner and getattr(home, name, None) is original:
        setattr(home, name, wrapper)
    elif home is not owner or name != attribute:
        wrapper.__module__, wrapper.__qualname__ = owner.__name__, attribute
    setattr(owner, attribute, wrapper)
