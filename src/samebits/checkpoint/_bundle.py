"""What a bitwise resume needs, and how it splits into tensors (for DCP) and plain values.

`StateBundle` names the live objects; `collect` turns them into one flat dict of tensors
plus one JSON-able tree per rank, `apply` puts loaded values back.  Keys of rank-local
values carry `@rank<r>`, so DCP (which keeps one copy of a key saved by several ranks)
never merges two ranks' random states or expert shards.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from samebits.checkpoint._errors import CheckpointError
from samebits.checkpoint._rng import Generator, capture_rng_state, restore_rng_state


@dataclass
class StateBundle:
    """The live state of one rank that a bitwise resume restores.

    `save` reads it; `load` writes into it in place (`progress` is replaced by the saved
    dict).  Everything except `model` is optional.
    """

    model: nn.Module
    """Parameters and persistent buffers (`state_dict()`)."""

    optimizer: torch.optim.Optimizer | None = None
    """Its state is stored by parameter name, so the order of construction may change."""

    lr_scheduler: Any = None
    """Anything with `state_dict()` / `load_state_dict()` of plain values (LRScheduler)."""

    progress: dict[str, int] = field(default_factory=dict)
    """Loop position, e.g. {"step": next step to run, "consumed_samples": data position}.
    `save` names the checkpoint directory after progress["step"]."""

    generators: Mapping[str, Generator] = field(default_factory=dict)
    """This rank's own generators (torch.Generator or numpy.random.Generator), by name.
    The global Python, NumPy, torch CPU and CUDA states are always captured."""

    layout: Mapping[str, int] = field(default_factory=dict)
    """Parallel layout, e.g. {"dp": 2, "ep": 2}; loading under another layout is refused."""

    rank_local: Collection[str] = ()
    """Names of model parameters whose value differs per rank (expert-parallel shards);
    every other parameter must be identical on all ranks (DCP stores one copy of it)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    """Plain JSON-able values kept with the checkpoint (e.g. the run's config); `load`
    replaces them with the saved ones, so the caller can compare."""


def collect(bundle: StateBundle, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(flat tensors keyed for DCP, JSON-able tree with {"__tensor__": key} placeholders)."""
    tensors: dict[str, torch.Tensor] = {}
    rank_local = set(bundle.rank_local)

    def key_for(section: str, name: str) -> str:
        return f"{section}/{name}@rank{rank}" if name in rank_local else f"{section}/{name}"

    def put(key: str, value: torch.Tensor) -> dict[str, str]:
        tensors[key] = value.detach()
        return {"__tensor__": key}

    for name, value in bundle.model.state_dict().items():
        put(key_for("model", name), value)

    optimizer = None
    if bundle.optimizer is not None:
        names = _optimizer_param_names(bundle.model, bundle.optimizer)
        state_dict = bundle.optimizer.state_dict()
        optimizer = {
            "param_groups": [dict(g, params=[names[i] for i in g["params"]])
                             for g in state_dict["param_groups"]],
            "state": {
                names[index]: {k: put(f"{key_for('optim', names[index])}/{k}", v)
                               if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                for index, entry in state_dict["state"].items()
            },
        }

    rng = _encode(capture_rng_state(bundle.generators), f"rng@rank{rank}", put)
    plain = {
        "progress": dict(bundle.progress),
        "metadata": _encode(dict(bundle.metadata), "metadata", None),
        "optimizer": _encode(optimizer, "", None),
        "lr_scheduler": _encode(bundle.lr_scheduler.state_dict(), "", None)
        if bundle.lr_scheduler is not None else None,
        "rng": rng,
        "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                    for k, t in tensors.items()},
    }
    return tensors, plain


def empty_tensors(plain: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Allocate the tensors a rank's manifest lists, for DCP to load into."""
    return {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]))
            for k, v in plain["tensors"].items()}


def apply(bundle: StateBundle, tensors: Mapping[str, torch.Tensor], plain: Mapping[str, Any],
          *, skip_rng: Collection[str] = ()) -> None:
    """Put loaded values back into the bundle's live objects."""
    model_state = {k.removeprefix("model/").split("@rank")[0]: v
                   for k, v in tensors.items() if k.startswith("model/")}
    missing, unexpected = bundle.model.load_state_dict(model_state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"model entries do not match the checkpoint: missing {missing}, "
                              f"unexpected {unexpected}; build the same model before loading")

    optimizer = _decode(plain["optimizer"], tensors)
    if (optimizer is None) != (bundle.optimizer is None):
        raise CheckpointError("the checkpoint and the bundle disagree on having an optimizer")
    if bundle.optimizer is not None:
        names = _optimizer_param_names(bundle.model, bundle.optimizer)
        index_of = {name: index for index, name in names.items()}
        unknown = sorted(set(optimizer["state"]) - set(index_of))
        if unknown:
            raise CheckpointError(f"optimizer state for parameters this optimizer does not "
                                  f"hold: {unknown}")
        bundle.optimizer.load_state_dict({
            "state": {index_of[name]: entry for name, entry in optimizer["state"].items()},
            "param_groups": [dict(g, params=[index_of[n] for n in g["params"]])
                             for g in optimizer["param_groups"]],
        })

    if bundle.lr_scheduler is not None:
        bundle.lr_scheduler.load_state_dict(_decode(plain["lr_scheduler"], tensors))
    bundle.progress.clear()
    bundle.progress.update(plain["progress"])
    bundle.metadata.clear()
    bundle.metadata.update(_decode(plain["metadata"], tensors))
    restore_rng_state(_decode(plain["rng"], tensors), bundle.generators, skip=skip_rng)


def _optimizer_param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """state_dict index -> parameter name (indices count params in param_group order)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    names, index = {}, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in name_of:
                raise CheckpointError("the optimizer holds a parameter that is not in the "
                                      "bundle's model; give the model that owns every parameter")
            names[index] = name_of[id(param)]
            index += 1
    return names


def _encode(value: Any, prefix: str, put) -> Any:
    """Plain tree for JSON: tuples tagged, tensors stored through `put` when given."""
    if isinstance(value, torch.Tensor):
        if put is None:
            raise CheckpointError(f"unexpected tensor at {prefix!r} in a plain-value section")
        return put(prefix, value)
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise CheckpointError(f"non-string key {k!r} at {prefix!r}: state must be "
                                      "keyed by strings to be stored without pickle")
        return {k: _encode(v, f"{prefix}/{k}", put) for k, v in value.items()}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{prefix}/{i}", put) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{prefix}/{i}", put) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot store a {type(value).__name__} at {prefix!r} without "
                          "pickle; use tensors, numbers, strings, lists, tuples and dicts")


def _decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensors[value["__tensor__"]]
        if "__tuple__" in value:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        return {k: _decode(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value
