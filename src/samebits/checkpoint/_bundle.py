"""What a bitwise resume needs, and how it splits into tensors (for DCP) and plain values.

`collect` turns a `StateBundle` into flat tensors plus one JSON-able tree per rank; `check`
validates a rank's tree against the live bundle before any tensor is read, and `apply` puts
it back.  Rank-local keys carry ``@rank<r>`` so DCP never merges two ranks' values; a piece of
a global tensor (`StateBundle.shards`) records its place, for a load under another layout.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from samebits.checkpoint._errors import CheckpointError, MalformedFieldError
from samebits.checkpoint._rng import (GLOBAL_RNG_NAMES, Generator, capture_rng_state,
                                      check_rng_state, restore_rng_state)
from samebits.errors import ConfigError

_TENSOR, _TUPLE = "__tensor__", "__tuple__"  # tags of the JSON tree; reserved as dict keys
#: Deepest nesting of a plain value `save` writes (and `load` reads: deeper is damage).
MAX_DEPTH = 100
DAMAGED = "the file is damaged or was edited: load an older step-K directory or save again"


@dataclass(frozen=True)
class TensorShard:
    """Where this rank's tensor lies in a global one: the global shape and the offsets of its
    first element per dimension (as a DTensor's chunk list or a Megatron partition say)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass
class StateBundle:
    """The live state of one rank that a bitwise resume restores: `save` reads it, `load` writes
    into it in place.  Everything except `model` is optional."""

    model: nn.Module
    """Parameters and persistent buffers (`state_dict()`)."""

    optimizer: torch.optim.Optimizer | None = None
    """Its state is stored by parameter name, so the order of construction may change."""

    lr_scheduler: Any = None
    """Anything with `state_dict()` / `load_state_dict()` of plain values (LRScheduler)."""

    progress: dict[str, int] = field(default_factory=dict)
    """Loop position, e.g. {"step": next step to run (names the directory), "consumed_samples": n}."""

    generators: Mapping[str, Generator] = field(default_factory=dict)
    """This rank's own generators (torch or NumPy), by name; the global states are always captured."""

    layout: Mapping[str, int] = field(default_factory=dict)
    """Parallel layout, e.g. {"dp": 2, "ep": 2}; another one is refused unless `allow_layout_change`."""

    rank_local: Collection[str] = ()
    """Names of model parameters whose value differs per rank (expert-parallel shards);
    every other parameter must be identical on all ranks (DCP stores one copy of it)."""

    shards: Mapping[str, TensorShard] = field(default_factory=dict)
    """Model entries (by state_dict name) that are this rank's piece of a global tensor, with
    their place; rank-local, like their optimizer state of the shard's shape (same place)."""

    layout_change: dict[str, Any] | None = None
    """Set by `load`: None at the saved layout, else {"step", "from": {"world_size", "layout"},
    "to": {...}}."""

    metadata: dict[str, Any] = field(default_factory=dict)
    """Plain JSON-able values kept with the checkpoint (the run's config); `load` returns the saved ones."""

    layout_metadata: Collection[str] = ()
    """Dotted paths of `metadata` entries that describe the layout ("config.tp"), which
    `content_sha256`'s ``state_sha256`` leaves out."""


def collect(bundle: StateBundle, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(flat tensors keyed for DCP, JSON-able tree with {"__tensor__": key} placeholders)."""
    tensors: dict[str, torch.Tensor] = {}
    shards = dict(bundle.shards)
    rank_local = set(bundle.rank_local) | set(shards)
    places: dict[str, TensorShard] = {}  # key -> place of the tensors that are pieces

    def key_for(section: str, name: str) -> str:
        return f"{section}/{name}@rank{rank}" if name in rank_local else f"{section}/{name}"

    def put(key: str, value: torch.Tensor) -> dict[str, str]:
        tensors[key] = value.detach()
        return _Stored({_TENSOR: key})

    model_state = bundle.model.state_dict()
    unknown = sorted(set(shards) - set(model_state))
    if unknown:
        raise ConfigError(f"StateBundle.shards names {unknown}, which are not entries of the "
                          "model's state_dict(); give each shard's place under its state_dict name")
    for name, value in model_state.items():
        key = put(key_for("model", name), value)[_TENSOR]
        if name in shards:
            places[key] = _checked_place(name, shards[name], value)

    optimizer = None
    if bundle.optimizer is not None:
        names = _optimizer_param_names(bundle.model, bundle.optimizer)
        state_dict = bundle.optimizer.state_dict()
        state = {}
        for index, entry in state_dict["state"].items():
            name = names[index]
            state[name] = {k: put(f"{key_for('optim', name)}/{k}", v) if isinstance(v, torch.Tensor) else v
                           for k, v in entry.items()}
            for k, v in entry.items():  # moments shaped like their shard have its place
                if name in shards and isinstance(v, torch.Tensor) and v.shape == model_state[name].shape:
                    places[f"{key_for('optim', name)}/{k}"] = shards[name]
        optimizer = {"param_groups": [dict(g, params=[names[i] for i in g["params"]])
                                      for g in state_dict["param_groups"]], "state": state}

    rng = _encode(capture_rng_state(bundle.generators), f"rng@rank{rank}", put)
    plain = {
        "progress": _encode(dict(bundle.progress), "progress", None),
        "metadata": _encode(dict(bundle.metadata), "metadata", None),
        "optimizer": _encode(optimizer, "optimizer", None),
        "lr_scheduler": _encode(bundle.lr_scheduler.state_dict(), "lr_scheduler", None)
        if bundle.lr_scheduler is not None else None,
        "rng": rng,
        "tensors": {k: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                        **({"global_shape": list(places[k].global_shape),
                            "offsets": list(places[k].offsets)} if k in places else {})}
                    for k, t in tensors.items()},
    }
    return tensors, plain


def declared_places(bundle: StateBundle, rank: int) -> dict[str, tuple[list[int], list[int]] | None]:
    """Model key (as `collect` keys it for `rank`) -> (global shape, offsets) that the bundle
    declares for it (`StateBundle.shards`), or None for a tensor without a place."""
    shards = dict(bundle.shards)
    rank_local = set(bundle.rank_local) | set(shards)
    places = {}
    for name, value in bundle.model.state_dict().items():
        key = f"model/{name}@rank{rank}" if name in rank_local else f"model/{name}"
        place = _checked_place(name, shards[name], value) if name in shards else None
        places[key] = None if place is None else (list(place.global_shape), list(place.offsets))
    return places


def _checked_place(name: str, place: TensorShard, value: torch.Tensor) -> TensorShard:
    """`place` as plain ints, refused unless it holds `value`'s shape inside the global one."""
    shape, global_shape, offsets = list(value.shape), list(place.global_shape), list(place.offsets)
    if (len(global_shape) != len(shape) or len(offsets) != len(shape)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                       for n in (*global_shape, *offsets))
            or any(o + n > g for o, n, g in zip(offsets, shape, global_shape))):
        raise ConfigError(f"StateBundle.shards[{name!r}] places a tensor of shape {shape} at "
                          f"offsets {offsets} of a global tensor of shape {global_shape}, which "
                          "does not hold it; give the global shape and the offsets of this "
                          "rank's piece (one non-negative int per dimension)")
    return TensorShard(tuple(global_shape), tuple(offsets))


def empty_tensors(plain: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Allocate the tensors a rank's manifest lists, for DCP to load into (after `check` and
    the storage checks: every element is then covered by exactly one chunk read)."""
    return {k: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]))
            for k, v in plain["tensors"].items()}


@dataclass
class Plan:
    """A rank's checkpoint tree, checked against the live bundle, ready to apply once the
    tensors are read.  Tensor references are `_Ref`s until then."""

    source: str
    model: dict[str, str]  # state_dict name -> manifest key
    optimizer: dict[str, Any] | None  # torch's state_dict layout, in the live optimizer's indices
    lr_scheduler: dict[str, Any] | None
    progress: dict[str, Any]
    metadata: dict[str, Any]
    rng: dict[str, Any]
    skip_rng: tuple[str, ...]


@dataclass(frozen=True)
class _Ref:
    key: str


class _Stored(dict):
    """{"__tensor__": key} of a tensor `collect` stored: `_encode` passes it through."""


class _Fields:
    """Builds the errors of one rank's file: what is wrong, where (file, field), what to do."""

    def __init__(self, source: str):
        self.source = source

    def bad(self, field_name: str, problem: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: field {field_name}: {problem}; {DAMAGED}")

    def mismatch(self, what: str, detail: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {detail}; build the {what} exactly as for the "
                               "saved run before loading (or, if the file was edited, load an "
                               "older step-K directory)")


def check(bundle: StateBundle, plain: Mapping[str, Any], *, rank: int, source: str,
          skip_rng: Collection[str] = ()) -> Plan:
    """Check a rank's tree (`_storage` has checked its top-level fields and tensor manifest)
    against the bundle, before any tensor is read or any live state changed."""
    fields = _Fields(source)
    manifest: Mapping[str, Any] = plain["tensors"]
    used: set[str] = set()

    def refs_at(expected: Callable[[tuple[str, ...]], Collection[str]] | None):
        """A tensor reference is allowed where `save` puts one, naming the key `save` gives
        it (`expected(path)`), listed in the manifest and referred to once."""
        def ref(key: Any, path: tuple[str, ...], where: str) -> _Ref:
            if expected is None:
                raise fields.bad(where, "refers to a tensor, but this field holds plain values")
            allowed = expected(path)
            if not isinstance(key, str) or key not in allowed:
                raise fields.bad(where, f"refers to tensor {key!r}; save stores this value as "
                                        f"{' or '.join(map(repr, sorted(allowed)))}")
            if key not in manifest:
                raise fields.bad(where, f"refers to tensor {key!r}, which the manifest "
                                        "('tensors') does not list")
            if key in used:
                raise fields.bad(where, f"refers to tensor {key!r}, which another field uses")
            used.add(key)
            return _Ref(key)
        ref.fields = fields
        return ref

    plain_only = refs_at(None)

    model = _check_model(bundle, manifest, fields, rank, used)
    optimizer = _check_optimizer(bundle, plain["optimizer"], fields, rank, refs_at, plain_only)

    lr_scheduler = None
    if bundle.lr_scheduler is not None:
        saved = plain["lr_scheduler"]
        if saved is None:
            raise fields.mismatch("LR scheduler", "the checkpoint holds no LR scheduler state "
                                                  "but the bundle has an LR scheduler")
        lr_scheduler = _decode(saved, "lr_scheduler", (), plain_only)
        _check_kind(lr_scheduler, bundle.lr_scheduler.state_dict(), "lr_scheduler", fields)

    progress = _decode(plain["progress"], "progress", (), plain_only)
    if not isinstance(progress, dict):
        raise fields.bad("progress", f"is a {_kind(progress)}, not an object")
    step = progress.get("step")
    if not (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        raise fields.bad("progress.step", f"is {step!r}, not the next step to run (an int >= 0)")
    metadata = _decode(plain["metadata"], "metadata", (), plain_only)
    if not isinstance(metadata, dict):
        raise fields.bad("metadata", f"is a {_kind(metadata)}, not an object")

    rng_prefix = f"rng@rank{rank}"
    rng = _decode(plain["rng"], "rng", (), refs_at(lambda path: {"/".join((rng_prefix, *path))}))
    skip = _check_rng(bundle, rng, fields, skip_rng)

    unused = sorted(set(manifest) - used)
    if unused:
        raise fields.bad(f"tensors.{unused[0]}", f"lists a tensor that no field refers to "
                                                 f"({len(unused)} such)")
    return Plan(source=source, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                progress=progress, metadata=metadata, rng=rng, skip_rng=skip)


def _check_model(bundle: StateBundle, manifest: Mapping[str, Any], fields: _Fields, rank: int,
                 used: set[str]) -> dict[str, str]:
    """state_dict entry -> manifest key: every manifest key under model/ is an entry of the
    live model, of its shape and dtype, and every entry has one (the keys go to ``used``)."""
    live_model = bundle.model.state_dict()
    model: dict[str, str] = {}
    own = f"@rank{rank}"
    for key in manifest:
        if not key.startswith("model/"):
            continue
        name = key[len("model/"):]
        if name.endswith(own):
            name = name[:-len(own)]
        elif "@rank" in name:
            raise fields.bad(f"tensors.{key}", f"is another rank's tensor, not rank {rank}'s")
        if name in model:
            raise fields.bad(f"tensors.{key}", f"stores model entry {name!r} a second time "
                                               f"(also as {model[name]!r})")
        model[name] = key
        used.add(key)
    missing, unexpected = sorted(set(live_model) - set(model)), sorted(set(model) - set(live_model))
    if missing or unexpected:
        raise CheckpointError(f"{fields.source}: model entries do not match the checkpoint: missing "
                              f"{missing}, unexpected {unexpected}; build the same model before "
                              "loading")
    for name, key in model.items():
        spec, live = manifest[key], live_model[name]
        if not isinstance(live, torch.Tensor):
            raise fields.mismatch("model", f"the bundle's model entry {name!r} is a "
                                           f"{type(live).__name__}, not a tensor")
        if list(live.shape) != spec["shape"] or live.dtype != getattr(torch, spec["dtype"]):
            raise fields.mismatch("model", f"model entry {name!r} is {spec['dtype']}"
                                           f"{spec['shape']} in the checkpoint but "
                                           f"{_describe(live)} in the bundle's model")
    return model


def _check_rng(bundle: StateBundle, rng: Any, fields: _Fields, skip_rng: Collection[str]) -> tuple[str, ...]:
    """The saved random states are the bundle's generators (and the devices this process
    sees); returns the states to leave out (``skip_rng``, each one a known state)."""
    if not isinstance(rng, dict) or not isinstance(rng.get("generators"), dict):
        raise fields.bad("rng", "is not an object with the saved generators under 'generators'")
    saved_names, names = sorted(rng["generators"]), sorted(bundle.generators)
    if saved_names != names:
        raise fields.mismatch("generators", f"the checkpoint holds generators {saved_names} but "
                                            f"the bundle passes {names}; pass the same named "
                                            "generators")
    skip = tuple(skip_rng)
    unknown = sorted(set(skip) - set(GLOBAL_RNG_NAMES) - set(saved_names))
    if unknown:
        raise ConfigError(f"cannot skip unknown random state(s) {', '.join(unknown)}; known: "
                          f"{', '.join(sorted(set(GLOBAL_RNG_NAMES) | set(saved_names)))}")
    if "cuda" not in skip:
        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        cuda = rng.get("cuda")
        count = len(cuda) if isinstance(cuda, list) else 0
        if count != present:
            raise fields.mismatch("process's visible devices",
                                  f"the checkpoint holds CUDA random states for {count} "
                                  f"device(s) but this process sees {present}")
    return skip


def _check_optimizer(bundle: StateBundle, saved: Any, fields: _Fields, rank: int, refs_at,
                     plain_only) -> dict[str, Any] | None:
    if (saved is None) != (bundle.optimizer is None):
        raise CheckpointError(f"{fields.source}: the checkpoint and the bundle disagree on "
                              "having an optimizer")
    if bundle.optimizer is None:
        return None
    if not isinstance(saved, dict) or set(saved) != {"param_groups", "state"}:
        raise fields.bad("optimizer", "is not an object of 'param_groups' and 'state'")
    names = _optimizer_param_names(bundle.model, bundle.optimizer)
    index_of = {name: index for index, name in names.items()}
    live_groups = bundle.optimizer.state_dict()["param_groups"]
    groups = saved["param_groups"]
    if not isinstance(groups, list):
        raise fields.bad("optimizer.param_groups", f"is a {_kind(groups)}, not a list")
    if len(groups) != len(live_groups):
        raise fields.mismatch("optimizer", f"field optimizer.param_groups holds {len(groups)} "
                                           f"group(s), the bundle's optimizer {len(live_groups)}")
    loaded_groups = []
    for i, (group, live) in enumerate(zip(groups, live_groups)):
        where = f"optimizer.param_groups[{i}]"
        if not isinstance(group, dict):
            raise fields.bad(where, f"is a {_kind(group)}, not an object")
        params = group.get("params")
        if (not isinstance(params, list) or not all(isinstance(n, str) for n in params)
                or len(set(params)) != len(params)):
            raise fields.bad(f"{where}.params", "is not a list of distinct parameter names")
        live_names = [names[j] for j in live["params"]]
        if set(params) != set(live_names):
            raise fields.mismatch("optimizer", f"param group {i} holds {sorted(params)} in the "
                                               f"checkpoint but {sorted(live_names)} in the "
                                               "bundle's optimizer")
        settings = {}
        for key, value in group.items():
            if key == "params":
                continue
            if key not in live:
                raise fields.bad(f"{where}.{key}", "is not a setting of this optimizer's param "
                                                   f"groups (they have {sorted(live)})")
            settings[key] = _decode(value, f"{where}.{key}", (), plain_only)
            _check_kind(settings[key], live[key], f"{where}.{key}", fields)
        # the live group's params, in its own order: torch maps saved indices by position
        loaded_groups.append({**{k: v for k, v in live.items() if k != "params"}, **settings,
                              "params": list(live["params"])})
    state = saved["state"]
    if not isinstance(state, dict):
        raise fields.bad("optimizer.state", f"is a {_kind(state)}, not an object")
    loaded_state = {}
    for name, entry in state.items():
        if name not in index_of:
            raise CheckpointError(f"{fields.source}: optimizer state for parameters this "
                                  f"optimizer does not hold: {[name]}")
        if not isinstance(entry, dict):
            raise fields.bad(f"optimizer.state.{name}", f"is a {_kind(entry)}, not an object")
        keys = lambda path, n=name: {f"optim/{n}/{path[0]}", f"optim/{n}@rank{rank}/{path[0]}"}  # noqa: E731
        ref = refs_at(lambda path, keys=keys: keys(path) if len(path) == 1 else set())
        loaded_state[index_of[name]] = {
            k: _decode(v, f"optimizer.state.{name}.{k}", (k,), ref) for k, v in entry.items()}
    return {"state": loaded_state, "param_groups": loaded_groups}


def check_loaded(bundle: StateBundle, tensors: Mapping[str, torch.Tensor], plan: Plan) -> None:
    """The last check before `apply`: the loaded random states, tried on scratch generators."""
    try:
        check_rng_state(_resolve(plan.rng, tensors), bundle.generators, skip=plan.skip_rng)
    except MalformedFieldError as err:
        raise CheckpointError(f"{plan.source}: field rng.{err.field}: {err.problem}; "
                              f"{DAMAGED}") from None


def apply(bundle: StateBundle, tensors: Mapping[str, torch.Tensor], plan: Plan) -> None:
    """Put loaded values back into the bundle's live objects (`check` and `check_loaded` have
    passed on every rank: nothing here refuses what they accepted)."""
    missing, unexpected = bundle.model.load_state_dict(
        {name: tensors[key] for name, key in plan.model.items()}, strict=False)
    if missing or unexpected:  # `check` matched them: a model that changed since
        raise CheckpointError(f"model entries do not match the checkpoint: missing {missing}, "
                              f"unexpected {unexpected}; build the same model before loading")
    if bundle.optimizer is not None:
        bundle.optimizer.load_state_dict(_resolve(plan.optimizer, tensors))
    if bundle.lr_scheduler is not None:
        bundle.lr_scheduler.load_state_dict(plan.lr_scheduler)
    bundle.progress.clear()
    bundle.progress.update(plan.progress)
    bundle.metadata.clear()
    bundle.metadata.update(plan.metadata)
    restore_rng_state(_resolve(plan.rng, tensors), bundle.generators, skip=plan.skip_rng)


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


def _encode(value: Any, prefix: str, put, depth: int = 0) -> Any:
    """Plain tree for JSON: tuples tagged, tensors stored through `put` when given."""
    if depth > MAX_DEPTH:
        raise CheckpointError(f"{prefix!r} is nested deeper than {MAX_DEPTH} levels; store "
                              "flatter values")
    if isinstance(value, torch.Tensor):
        if put is None:
            raise CheckpointError(f"unexpected tensor at {prefix!r} in a plain-value section")
        return put(prefix, value)
    if isinstance(value, _Stored):
        return dict(value)
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise CheckpointError(f"non-string key {k!r} at {prefix!r}: state must be "
                                      "keyed by strings to be stored without pickle")
            if k in (_TENSOR, _TUPLE):
                raise CheckpointError(f"key {k!r} at {prefix!r} is reserved: the checkpoint "
                                      "tags tensors and tuples with it; rename the key")
        return {k: _encode(v, f"{prefix}/{k}", put, depth + 1) for k, v in value.items()}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{prefix}/{i}", put, depth + 1)
                         for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{prefix}/{i}", put, depth + 1) for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise CheckpointError(f"cannot store a {type(value).__name__} at {prefix!r} without "
                          "pickle; use tensors, numbers, strings, lists, tuples and dicts")


def _decode(value: Any, where: str, path: tuple[str, ...], ref) -> Any:
    """Inverse of `_encode`: tuples back, tensor references as `_Ref`s through `ref(key,
    path, where)` (which refuses them where `save` puts none).  A tag with company, or a
    tuple tag on something else, is damage (`ref.fields` says where)."""
    if isinstance(value, dict):
        if _TENSOR in value or _TUPLE in value:
            tag = _TENSOR if _TENSOR in value else _TUPLE
            if len(value) != 1:
                raise ref.fields.bad(where, f"holds the {tag} tag together with other keys "
                                            f"{sorted(value)}")
            if tag == _TENSOR:
                return ref(value[_TENSOR], path, where)
            items = value[_TUPLE]
            if not isinstance(items, list):
                raise ref.fields.bad(where, f"holds a {_TUPLE} tag on a {_kind(items)}, not a list")
            return tuple(_decode(v, f"{where}[{i}]", (*path, str(i)), ref)
                         for i, v in enumerate(items))
        return {k: _decode(v, f"{where}.{k}", (*path, k), ref) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v, f"{where}[{i}]", (*path, str(i)), ref) for i, v in enumerate(value)]
    return value


def _resolve(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, _Ref):
        return tensors[value.key]
    if isinstance(value, dict):
        return {k: _resolve(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(_resolve(v, tensors) for v in value)
    return value


def _check_kind(saved: Any, live: Any, where: str, fields: _Fields) -> None:
    """`saved` must be `live` (the live object's own state_dict) value for value in kind: dicts
    with exactly its keys (`load_state_dict` would set extra ones as attributes), sequences of
    its length, numbers for numbers, strings for strings, null for null."""
    if isinstance(live, dict):
        if not isinstance(saved, dict):
            raise fields.bad(where, f"is a {_kind(saved)}, but the live state has an object here")
        lacking = sorted(set(map(str, live)) - set(saved))
        if lacking:
            raise fields.bad(f"{where}.{lacking[0]}", "is missing; the live object's state_dict "
                                                      "has it")
        for key, value in saved.items():
            if key not in live:
                raise fields.bad(f"{where}.{key}", "is not in the live object's state_dict "
                                                   f"(it has {sorted(map(str, live))}); the "
                                                   "checkpoint may only set those")
            _check_kind(value, live[key], f"{where}.{key}", fields)
    elif isinstance(live, (list, tuple)):
        if _kind(saved) != _kind(live) or len(saved) != len(live):
            raise fields.bad(where, f"is {_describe(saved)}, but the live state has "
                                    f"{_describe(live)} here")
        for i, (value, live_value) in enumerate(zip(saved, live)):
            _check_kind(value, live_value, f"{where}[{i}]", fields)
    elif _kind(saved) != _kind(live):
        raise fields.bad(where, f"is {_describe(saved)}, but the live state has "
                                f"{_describe(live)} here")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    for kind, name in ((str, "string"), (tuple, "tuple"), (list, "list"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"a {_kind(value)} of {len(value)}"
    shown = repr(value)
    return f"a {_kind(value)} ({shown if len(shown) <= 40 else shown[:37] + '...'})"
