"""Capture and restore every random state of one rank as tensors and plain values (no pickle);
restoring is all or nothing: `check_rng_state` tries every state on a scratch generator first.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Any, Union

import numpy as np
import torch

from samebits.checkpoint._errors import MalformedFieldError
from samebits.errors import ConfigError

Generator = Union[torch.Generator, np.random.Generator]

#: Names of the global states; a bundle's own generators are named by the caller.
GLOBAL_RNG_NAMES = ("python", "numpy", "torch_cpu", "cuda")

_MT_WORDS = 624  # Mersenne Twister state words (Python's and NumPy's)
_UINT32 = 1 << 32
# dtypes a NumPy bit generator's state arrays may have (MT19937's key is uint32)
_STATE_ARRAY_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64",
                                 "int8", "int16", "int32", "int64"})


def capture_rng_state(generators: Mapping[str, Generator] | None = None) -> dict[str, Any]:
    """Every random state of this process (Python, NumPy's global, torch CPU, each visible CUDA
    device's, each named generator) as tensors and plain data, nothing by reference."""
    version, mt_state, gauss = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"bit_generator": numpy_state["bit_generator"],
                  "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                  "pos": int(numpy_state["state"]["pos"]),
                  "has_gauss": int(numpy_state["has_gauss"]),
                  "gauss": float(numpy_state["gauss"])},
        "torch_cpu": torch.get_rng_state(),
        "generators": {name: _generator_state(name, gen)
                       for name, gen in (generators or {}).items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, Generator] | None = None,
                      *, skip: Collection[str] = ()) -> None:
    """Inverse of `capture_rng_state`, for the same generator names.  `skip` leaves the named
    states as they are (a test switch: what a lost random state does to a resume)."""
    generators = dict(generators or {})
    check_rng_state(state, generators, skip=skip)
    if "python" not in skip:
        random.setstate(_python_state(state["python"]))
    if "numpy" not in skip:
        np.random.set_state(_numpy_state(state["numpy"]))
    if "torch_cpu" not in skip:
        torch.set_rng_state(state["torch_cpu"])
    if "cuda" not in skip and state.get("cuda"):  # checked against the visible devices above
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, gen in generators.items():
        if name in skip:
            continue
        if isinstance(gen, torch.Generator):  # each state's kind checked above
            gen.set_state(state["generators"][name])
        else:
            gen.bit_generator.state = _unplain(state["generators"][name], f"generators.{name}")


def check_rng_state(state: Any, generators: Mapping[str, Generator] | None = None, *,
                    skip: Collection[str] = ()) -> None:
    """Refuse, before anything is restored, a state that `restore_rng_state` cannot take whole:
    unknown `skip` names or other generators are a `ConfigError`, a field `capture_rng_state`
    could not have written a `MalformedFieldError`.  Every state, skipped ones too, is tried
    on a scratch generator of its kind first.
    """
    generators = dict(generators or {})
    if not isinstance(state, Mapping):
        raise MalformedFieldError("", f"is a {type(state).__name__}, not a dict")
    required = {"python", "numpy", "torch_cpu", "generators"}
    missing, extra = sorted(required - set(state)), sorted(set(state) - required - {"cuda"})
    if missing or extra:
        raise MalformedFieldError("", f"has fields {sorted(state, key=str)}, expected "
                                      f"{sorted(required)} (and 'cuda' where CUDA is available)")
    if not isinstance(state["generators"], Mapping):
        raise MalformedFieldError("generators", f"is a {type(state['generators']).__name__}, "
                                                "not a dict of generator states by name")
    saved_names = set(state["generators"])
    known = set(GLOBAL_RNG_NAMES) | saved_names
    unknown = sorted(set(skip) - known)
    if unknown:
        raise ConfigError(f"cannot skip unknown random state(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    if saved_names != set(generators):
        raise ConfigError(f"the checkpoint holds generators {sorted(saved_names)} but the bundle "
                         f"passes {sorted(generators)}; pass the same named generators")
    _try("python", _python_state(state["python"]), lambda s: random.Random().setstate(s))
    _try("numpy", _numpy_state(state["numpy"]),
         lambda s: np.random.RandomState().set_state(s))
    _check_torch_state("torch_cpu", state["torch_cpu"], torch.get_rng_state(), torch.Generator())
    if "cuda" in state:
        cuda = state["cuda"]
        if not isinstance(cuda, (list, tuple)):
            raise MalformedFieldError("cuda", f"is a {type(cuda).__name__}, not a list of "
                                              "per-device states")
        for index, value in enumerate(cuda):
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
                    and value.dim() == 1):
                raise MalformedFieldError(f"cuda.{index}", "is not a 1-D uint8 tensor")
    if "cuda" not in skip:
        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        saved = state.get("cuda")
        if (saved is None) != (present == 0) or (saved is not None and len(saved) != present):
            raise ConfigError(f"the checkpoint holds CUDA random states for "
                             f"{0 if saved is None else len(saved)} device(s) but this process "
                             f"sees {present}; resume with the same visible devices")
        for index, value in enumerate(saved or ()):
            _check_torch_state(f"cuda.{index}", value, torch.cuda.get_rng_state(index),
                               torch.Generator(device=f"cuda:{index}"))
    for name, gen in generators.items():
        value = state["generators"][name]
        if isinstance(gen, torch.Generator):
            if not isinstance(value, torch.Tensor):
                raise MalformedFieldError(f"generators.{name}", "holds a NumPy state for a "
                                                                "torch.Generator")
            _check_torch_state(f"generators.{name}", value, gen.get_state(),
                               torch.Generator(device=gen.device))
        elif isinstance(gen, np.random.Generator):
            kind = type(gen.bit_generator)
            if not isinstance(value, Mapping) or value.get("bit_generator") != kind.__name__:
                raise MalformedFieldError(f"generators.{name}", f"is not a {kind.__name__} "
                                                                "bit-generator state")
            scratch = kind()
            _try(f"generators.{name}", _unplain(value, f"generators.{name}"),
                 lambda s: setattr(scratch, "state", s))
        else:
            _generator_state(name, gen)  # raises the ConfigError naming what it is


def _python_state(value: Any) -> tuple:
    """The tuple `random.setstate` takes, from capture's {version, state, gauss}."""
    _fields("python", value, ("version", "state", "gauss"))
    version, words, gauss = value["version"], value["state"], value["gauss"]
    if not _is_int(version):
        raise MalformedFieldError("python.version", f"is {version!r}, not an int")
    _check_words("python.state", words, _MT_WORDS + 1)
    position = int(words[_MT_WORDS])
    if not 0 <= position <= _MT_WORDS:
        raise MalformedFieldError("python.state", f"ends with position {position}, not one "
                                                  f"in [0, {_MT_WORDS}]")
    if gauss is not None and not _is_number(gauss):
        raise MalformedFieldError("python.gauss", f"is {gauss!r}, not a float or null")
    return int(version), tuple(words.tolist()), None if gauss is None else float(gauss)


def _numpy_state(value: Any) -> dict[str, Any]:
    """The dict `np.random.set_state` takes, from capture's flat fields."""
    _fields("numpy", value, ("bit_generator", "key", "pos", "has_gauss", "gauss"))
    if value["bit_generator"] != "MT19937":
        raise MalformedFieldError("numpy.bit_generator", f"is {value['bit_generator']!r}, not "
                                                         "'MT19937' (NumPy's global state)")
    _check_words("numpy.key", value["key"], _MT_WORDS)
    pos, has_gauss, gauss = value["pos"], value["has_gauss"], value["gauss"]
    if not (_is_int(pos) and 0 <= pos <= _MT_WORDS):
        raise MalformedFieldError("numpy.pos", f"is {pos!r}, not an int in [0, {_MT_WORDS}]")
    if not (_is_int(has_gauss) and has_gauss in (0, 1)):
        raise MalformedFieldError("numpy.has_gauss", f"is {has_gauss!r}, not 0 or 1")
    if not _is_number(gauss):
        raise MalformedFieldError("numpy.gauss", f"is {gauss!r}, not a float")
    return {"bit_generator": "MT19937",
            "state": {"key": value["key"].numpy().astype(np.uint32), "pos": int(pos)},
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def _check_words(field: str, words: Any, count: int) -> None:
    """An int64 tensor of `count` Mersenne Twister words, each a uint32 (the last of
    Python's is its position, checked by the caller)."""
    if not (isinstance(words, torch.Tensor) and words.dtype == torch.int64
            and tuple(words.shape) == (count,)):
        raise MalformedFieldError(field, f"is {_kind(words)}, not an int64[{count}] tensor")
    body = words[:_MT_WORDS]
    if body.numel() and (int(body.min()) < 0 or int(body.max()) >= _UINT32):
        raise MalformedFieldError(field, "holds a word outside [0, 2**32)")


def _check_torch_state(field: str, value: Any, like: torch.Tensor, scratch: torch.Generator) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
            and value.shape == like.shape):
        raise MalformedFieldError(field, f"is {_kind(value)}, not the uint8{list(like.shape)} tensor "
                                         "of a generator's state")
    _try(field, value, scratch.set_state)


def _kind(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    return type(value).__name__


def _try(field: str, value: Any, setter) -> None:
    """Set `value` on a scratch generator: what it refuses is malformed."""
    try:
        setter(value)
    except Exception as err:  # noqa: BLE001  (each generator refuses in its own way)
        raise MalformedFieldError(field, f"is refused by the generator "
                                         f"({type(err).__name__}: {err})") from None


def _fields(field: str, value: Any, names: tuple[str, ...]) -> None:
    if not isinstance(value, Mapping) or set(value) != set(names):
        got = sorted(value, key=str) if isinstance(value, Mapping) else type(value).__name__
        raise MalformedFieldError(field, f"holds {got}, expected fields {list(names)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _generator_state(name: str, gen: Generator) -> Any:
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return _plain(gen.bit_generator.state)
    raise ConfigError(f"generator {name!r} is a {type(gen).__name__}; pass a torch.Generator or "
                    "a numpy.random.Generator")


def _plain(value: Any) -> Any:
    """NumPy bit-generator state -> JSON-able (arrays tagged with their dtype)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.integer):
        return int(value)
    return value


def _unplain(value: Any, field: str) -> Any:
    """Inverse of `_plain`; an array must be a tagged list of ints of an integer dtype."""
    if isinstance(value, Mapping):
        if "__ndarray__" in value:
            items, dtype = value["__ndarray__"], value.get("dtype")
            if (set(value) != {"__ndarray__", "dtype"} or dtype not in _STATE_ARRAY_DTYPES
                    or not isinstance(items, list) or not all(_is_int(i) for i in items)):
                raise MalformedFieldError(field, "is not a tagged list of integers of an "
                                                 "integer dtype")
            try:
                return np.array(items, dtype=dtype)
            except (OverflowError, ValueError) as err:
                raise MalformedFieldError(field, f"holds a value outside {dtype} ({err})") from None
        return {k: _unplain(v, f"{field}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_unplain(v, f"{field}.{i}") for i, v in enumerate(value)]
    return value
