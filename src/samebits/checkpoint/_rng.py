"""Capture and restore every random state of one rank, as tensors and plain values.

No pickle anywhere: Python's and NumPy's Mersenne Twister states become int64 tensors plus
a few plain numbers, torch states are their uint8 tensors, and a NumPy `Generator`'s state
is its plain dict (arrays tagged as lists), so a checkpoint loads with `weights_only`-style
safety.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping
from typing import Any, Union

import numpy as np
import torch

from samebits.errors import ConfigError

Generator = Union[torch.Generator, np.random.Generator]

#: Names of the global states; a bundle's own generators are named by the caller.
GLOBAL_RNG_NAMES = ("python", "numpy", "torch_cpu", "cuda")


def capture_rng_state(generators: Mapping[str, Generator] | None = None) -> dict[str, Any]:
    """Every random state of this process: Python `random`, NumPy's global state, torch CPU,
    torch CUDA (one state per visible device, when CUDA is available) and each named
    generator.  Values are tensors and plain JSON-able data; nothing is copied by reference.
    """
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
    """Inverse of `capture_rng_state`.  `generators` must hold the same names as at capture.

    `skip` leaves the named states (global names or generator names) as they are: a test
    switch that shows what a lost random state does to a resume.
    """
    generators = dict(generators or {})
    saved_names = set(state["generators"])
    known = set(GLOBAL_RNG_NAMES) | saved_names
    unknown = sorted(set(skip) - known)
    if unknown:
        raise ConfigError(f"cannot skip unknown random state(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    if saved_names != set(generators):
        raise ConfigError(f"the checkpoint holds generators {sorted(saved_names)} but the bundle "
                         f"passes {sorted(generators)}; pass the same named generators")
    if "python" not in skip:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(py["state"].tolist()), py["gauss"]))
    if "numpy" not in skip:
        nps = state["numpy"]
        np.random.set_state({
            "bit_generator": nps["bit_generator"],
            "state": {"key": nps["key"].numpy().astype(np.uint32), "pos": int(nps["pos"])},
            "has_gauss": int(nps["has_gauss"]), "gauss": float(nps["gauss"]),
        })
    if "torch_cpu" not in skip:
        torch.set_rng_state(state["torch_cpu"])
    if "cuda" not in skip:
        _restore_cuda(state.get("cuda"))
    for name, gen in generators.items():
        if name not in skip:
            _set_generator_state(name, gen, state["generators"][name])


def _restore_cuda(saved: list[torch.Tensor] | None) -> None:
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved is None and present == 0:
        return
    if saved is None or len(saved) != present:
        raise ConfigError(f"the checkpoint holds CUDA random states for "
                         f"{0 if saved is None else len(saved)} device(s) but this process sees "
                         f"{present}; resume with the same visible devices")
    torch.cuda.set_rng_state_all(saved)


def _generator_state(name: str, gen: Generator) -> Any:
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    if isinstance(gen, np.random.Generator):
        return _plain(gen.bit_generator.state)
    raise ConfigError(f"generator {name!r} is a {type(gen).__name__}; pass a torch.Generator or "
                    "a numpy.random.Generator")


def _set_generator_state(name: str, gen: Generator, value: Any) -> None:
    if isinstance(gen, torch.Generator):
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"generator {name!r}: the checkpoint holds a NumPy state for a "
                             "torch.Generator")
        gen.set_state(value)
    else:
        gen.bit_generator.state = _unplain(value)


def _plain(value: Any) -> Any:
    """NumPy bit-generator state -> JSON-able (arrays tagged with their dtype)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.integer):
        return int(value)
    return value


def _unplain(value: Any) -> Any:
    if isinstance(value, dict):
        if "__ndarray__" in value:
            return np.array(value["__ndarray__"], dtype=value["dtype"])
        return {k: _unplain(v) for k, v in value.items()}
    return value
