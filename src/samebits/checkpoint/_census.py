"""The state census: the training state a resume must restore, as named CPU tensors, recorded at
each step's start in the census stream (`CENSUS_DIR`: context, never part of the verdict) to name
the state a resume lost (docs/checkpoint.md, "The state census").  It runs every step: at most
one sync per device, outside every dispatch mode in force (no tracer sees it).
"""

from __future__ import annotations

import numbers
import random
import struct
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from samebits._torchutil import outside_dispatch_modes
from samebits.errors import ConfigError
from samebits.checkpoint._names import OPTIMIZER, SCALER, SCHEDULER, CensusName
from samebits.stream import Recorder
from samebits.stream.phases import STATE

try:  # a dependency of samebits, but the census works without it (no rng.numpy record)
    import numpy as _np
except ImportError:  # pragma: no cover - exercised by loading this file with numpy blocked
    _np = None

STATE_PHASE = STATE  # the census phase, recorded at each step start (samebits.stream.phases)
#: The census stream's folder inside a run directory: every recorder writes the census there,
#: beside the run's main stream and never into it (context, not part of the verdict).
CENSUS_DIR = "state"


def state_census(*, optimizers: Sequence[Any] = (), schedulers: Sequence[Any] = (),
                 generators: Mapping[str, Any] | None = None, scalers: Sequence[Any] = (),
                 include_cuda: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Named CPU tensors whose bits are this process's RNG, optimizer-step and LR state, in the
    order of docs/checkpoint.md's table (rng.cuda:<i> only when `include_cuda` and CUDA is
    initialised: the census never initialises it).  A bad argument is a ConfigError naming it.
    """
    optimizers = _checked_sequence("optimizers", optimizers, _is_optimizer,
                                   "a torch.optim.Optimizer (param_groups and state)")
    schedulers = _checked_sequence("schedulers", schedulers, _is_scheduler,
                                   "an LR scheduler (last_epoch and get_last_lr())")
    scalers = _checked_sequence("scalers", scalers, _is_scaler, "a torch.amp.GradScaler")
    user = _checked_generators(generators)
    with outside_dispatch_modes():
        return _census(optimizers, schedulers, user, scalers, include_cuda)


def _census(optimizers, schedulers, user, scalers, include_cuda: bool) -> list[tuple[str, torch.Tensor]]:
    def named(kind: str, index: int, field: str = "") -> str:
        return str(CensusName.component(kind, index, field))

    records: list[tuple[str, torch.Tensor]] = [(str(CensusName.rng(name)), state())
                                               for name, state in _GLOBAL_STATES.items()]
    if include_cuda and torch.cuda.is_initialized():  # is_available() alone would not do:
        for index in range(torch.cuda.device_count()):  # reading a state must not init CUDA
            records.append((str(CensusName.cuda_rng(index)), torch.cuda.get_rng_state(index)))
    records += [(str(CensusName.user_rng(name)), _generator_state(generator)) for name, generator in user]
    for index, optimizer in enumerate(optimizers):
        records += [(named(OPTIMIZER, index, "step"), _optimizer_steps(optimizer)),
                    (named(OPTIMIZER, index, "lr"), _float64([g.get("lr") for g in optimizer.param_groups])),
                    (named(OPTIMIZER, index, "hparams"), _hyperparameters(optimizer))]
    for index, scheduler in enumerate(schedulers):
        records += [(named(SCHEDULER, index, "last_epoch"), torch.tensor([int(scheduler.last_epoch)])),
                    (named(SCHEDULER, index, "step_count"),
                     torch.tensor([int(getattr(scheduler, "_step_count", -1))])),
                    (named(SCHEDULER, index, "lr"), _float64(scheduler.get_last_lr()))]
    return records + [(named(SCALER, index), _scaler_state(scaler)) for index, scaler in enumerate(scalers)]


def census_recorder(recorder: Any, *, append: bool = False, config: Mapping[str, Any] | None = None) -> Recorder | None:
    """A `samebits.Recorder` for the census of the run ``recorder`` writes, in `CENSUS_DIR`
    inside its directory, with its rank and world size; ``append`` continues a resumed run's.
    None when ``recorder`` records nothing here or is not a samebits Recorder.  The caller
    closes it."""
    if not isinstance(recorder, Recorder) or not recorder.active:
        return None
    return Recorder(recorder.settings.directory / CENSUS_DIR, rank=recorder.rank, world_size=recorder.world_size,
                    config=config, append=append)


def census_run(run_dir: str | os.PathLike) -> Path | None:
    """Where the census of run ``run_dir`` is: ``run_dir/state`` (`CENSUS_DIR`), or, for a run
    recorded before 2026-12 with the census in its main stream, ``run_dir`` itself.  None when
    ``run_dir`` is not a directory."""
    run_dir = Path(run_dir)
    if (run_dir / CENSUS_DIR).is_dir():
        return run_dir / CENSUS_DIR
    return run_dir if run_dir.is_dir() else None


def global_rng_record(generator: str) -> torch.Tensor:
    """The census tensor of one global generator, ``python``, ``numpy`` or ``torch_cpu``
    (the bits of record ``rng.<generator>``), e.g. to compare a restored state with a census."""
    if generator in _GLOBAL_STATES:
        with outside_dispatch_modes():
            return _GLOBAL_STATES[generator]()
    raise ConfigError(f"global_rng_record({generator!r}): not a global generator; use 'python', 'numpy' "
                      "or 'torch_cpu'")


# --- the records ---------------------------------------------------------------------------


def _python_state() -> torch.Tensor:
    """int64[628]: version, the 625 state words (624 + position), has_gauss, gauss bits."""
    version, words, gauss = random.getstate()
    values = torch.empty(len(words) + 3, dtype=torch.int64)
    values[0] = version
    values[1:len(words) + 1] = torch.as_tensor(words, dtype=torch.int64)
    values[-2] = gauss is not None
    values[-1] = _float_bits(gauss) if gauss is not None else 0
    return values


def _numpy_global_state() -> torch.Tensor:
    """int64[627]: the 624 key words, pos, has_gauss, cached gaussian bits (legacy MT19937);
    uint8 bytes of the full state for any other bit generator."""
    state = _np.random.get_state()
    if isinstance(state, dict):  # the global RandomState was given another bit generator
        return _plain_bytes(state)
    _, key, pos, has_gauss, cached = state
    values = _np.empty(key.shape[0] + 3, dtype=_np.int64)
    values[:-3] = key
    values[-3:] = (pos, has_gauss, _float_bits(cached))
    return torch.from_numpy(values)


# The global generators' records, in census order (no rng.numpy without NumPy).
_GLOBAL_STATES = {"python": _python_state, **({"numpy": _numpy_global_state} if _np is not None else {}),
                  "torch_cpu": torch.get_rng_state}


def _generator_state(generator: Any) -> torch.Tensor:
    if isinstance(generator, torch.Generator):
        return generator.get_state()  # uint8, on the CPU whatever the generator's device
    return _plain_bytes(generator.bit_generator.state)


def _optimizer_steps(optimizer: Any) -> torch.Tensor:
    """float64 per parameter in param-group order: its "step" state, -1 without one."""
    steps: list[float] = []
    on_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    state = optimizer.state
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = state.get(param)
            step = None if entry is None else entry.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                on_device.setdefault(step.device, []).append((len(steps), step))
                steps.append(0.0)
            elif isinstance(step, torch.Tensor):
                steps.append(step.item())  # exact: float32/int64 step counts fit a float64
            else:
                steps.append(-1.0 if step is None else float(step))
    values = torch.tensor(steps, dtype=torch.float64)
    # One stack and one copy per device: step counts on a GPU (capturable/fused Adam) cost
    # one sync per step, not one per parameter.
    for tensors in on_device.values():
        positions = torch.tensor([position for position, _ in tensors])
        stacked = torch.stack([t.detach().reshape(()) for _, t in tensors])
        values[positions] = stacked.to(device="cpu", dtype=torch.float64)
    return values


def _hyperparameters(optimizer: Any) -> torch.Tensor:
    """float64: each group's numeric settings other than params and lr, keys sorted, tuples
    (betas) flattened; a group setting that is not a number counts as NaN."""
    values: list[Any] = []
    for group in optimizer.param_groups:
        for key in sorted(k for k in group if k not in ("params", "lr") and isinstance(k, str)):
            values += group[key] if isinstance(group[key], (tuple, list)) else (group[key],)
    return _float64(values)


def _scaler_state(scaler: Any) -> torch.Tensor:
    """float64[2]: the scale and growth tracker the scaler's next step uses (its initial ones
    before its first use, as its state_dict says); NaN, -1 when it is disabled."""
    if not scaler.is_enabled():
        return torch.tensor([float("nan"), -1.0], dtype=torch.float64)
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    scale = float(getattr(scaler, "_init_scale", float("nan"))) if scale is None else scale
    tracker = float(getattr(scaler, "_init_growth_tracker", -1)) if tracker is None else tracker
    device = next((v.device for v in (scale, tracker) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    values = [v.reshape(-1)[0].to(device=device, dtype=torch.float64) if isinstance(v, torch.Tensor)
              else torch.tensor(float(v), dtype=torch.float64, device=device) for v in (scale, tracker)]
    return torch.stack(values).cpu()  # widened where they live (exact), then one copy to the host


def _float64(values: Sequence[Any]) -> torch.Tensor:
    return torch.tensor([_number(v) for v in values], dtype=torch.float64)


def _number(value: Any) -> float:
    """A group setting as a float64, exactly: a Python number, a one-element tensor (a tensor
    LR, as capturable or compiled optimizers hold it), NaN for anything else (a group without
    an LR, as torchtitan's container has)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.detach().reshape(()).to("cpu", torch.float64))
    return float(value) if isinstance(value, numbers.Real) else float("nan")


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _plain_bytes(value: Any) -> torch.Tensor:
    """A NumPy bit-generator state (dicts, strings, ints of any size, arrays) as uint8,
    encoded without loss and in a fixed order."""
    out = bytearray()
    _encode(value, out)
    return torch.frombuffer(out, dtype=torch.uint8).clone()


def _encode(value: Any, out: bytearray) -> None:
    if isinstance(value, Mapping):
        out += b"d" + len(value).to_bytes(4, "little")
        for key in sorted(value, key=str):
            _encode(str(key), out)
            _encode(value[key], out)
    elif isinstance(value, str):
        data = value.encode()
        out += b"s" + len(data).to_bytes(4, "little") + data
    elif isinstance(value, bool):
        out += b"b" + bytes([value])
    elif isinstance(value, int) or (_np is not None and isinstance(value, _np.integer)):
        number = int(value)
        data = number.to_bytes((number.bit_length() + 8) // 8, "little", signed=True)
        out += b"i" + len(data).to_bytes(4, "little") + data
    elif isinstance(value, float) or (_np is not None and isinstance(value, _np.floating)):
        out += b"f" + struct.pack("<d", float(value))
    elif _np is not None and isinstance(value, _np.ndarray):
        _encode(str(value.dtype), out)
        _encode(list(value.shape), out)
        data = _np.ascontiguousarray(value).tobytes()
        out += b"a" + len(data).to_bytes(8, "little") + data
    elif isinstance(value, (list, tuple)):
        out += b"l" + len(value).to_bytes(4, "little")
        for item in value:
            _encode(item, out)
    elif value is None:
        out += b"n"
    else:
        _encode(repr(value), out)  # not seen in NumPy's bit generators; kept comparable


# --- argument checks -----------------------------------------------------------------------


def _is_optimizer(value: Any) -> bool:
    return isinstance(getattr(value, "param_groups", None), list) and \
        isinstance(getattr(value, "state", None), Mapping)


def _is_scheduler(value: Any) -> bool:
    return hasattr(value, "last_epoch") and callable(getattr(value, "get_last_lr", None))


def _is_scaler(value: Any) -> bool:
    # A GradScaler made with enabled=False (nanoGPT's on CPU or float32) has no _growth_tracker
    # at all: its methods and its enabled flag are what every GradScaler has.
    return callable(getattr(value, "get_scale", None)) and callable(getattr(value, "is_enabled", None))


def _checked_sequence(argument: str, values: Any, check, wanted: str) -> Sequence[Any]:
    if check(values):  # one object passed where a sequence was meant
        raise ConfigError(f"state_census({argument}=...) got one {type(values).__name__}; pass a "
                          f"list or tuple of them, e.g. {argument}=[x]")
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ConfigError(f"state_census({argument}=...) must be a list or tuple, not a "
                          f"{type(values).__name__}")
    for index, value in enumerate(values):
        if not check(value):
            raise ConfigError(f"state_census({argument}[{index}]) is a {type(value).__name__}, "
                              f"not {wanted}")
    return values


def _checked_generators(generators: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if generators is None:
        return []
    if not isinstance(generators, Mapping):
        raise ConfigError(f"state_census(generators=...) must be a dict of name -> "
                          f"torch.Generator, not a {type(generators).__name__}")
    numpy_generator = _np.random.Generator if _np is not None else ()
    for name, generator in generators.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"state_census(generators=...): generator names must be non-empty "
                              f"strings, got {name!r}")
        if not isinstance(generator, (torch.Generator, numpy_generator)):
            raise ConfigError(f"state_census(generators=...): {name!r} is a "
                              f"{type(generator).__name__}, not a torch.Generator (or "
                              "numpy.random.Generator); pass the generator object itself")
    return sorted(generators.items(), key=lambda item: item[0])
