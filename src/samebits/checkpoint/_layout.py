"""Loading a checkpoint under another layout: what each new rank reads, and what cannot move.

`plan_move` gives one new rank its tree as if `save` had written it (`Move.plain`), the saved
tensors to read (`Move.reads`) and how to cut its tensors from them (`Move.assemble`); what
cannot move bitwise (docs/checkpoint.md) is a `CheckpointLayoutError` naming it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from samebits.checkpoint._bundle import _TENSOR, StateBundle, collect
from samebits.checkpoint._errors import CheckpointLayoutError

_RANK_SUFFIX = re.compile(r"@rank\d+")
_PLAIN_FIELDS = ("progress", "metadata", "lr_scheduler", "optimizer")


def base_key(key: str) -> str:
    """The key without its `@rank<r>`: the same for every rank's piece of one tensor."""
    return _RANK_SUFFIX.sub("", key, count=1)


@dataclass
class _Piece:
    key: str  # as saved
    rank: int  # the lowest saved rank that holds it
    spec: dict[str, Any]
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.spec["shape"])


@dataclass
class Move:
    """One new rank's part of a load under another layout."""

    plain: dict[str, Any]  # the rank's tree, for `_bundle.check`
    reads: dict[str, dict[str, Any]]  # saved key -> saved spec (shape, dtype, digest)
    cuts: dict[str, list[tuple[str, tuple[slice, ...], tuple[slice, ...]]]] = field(default_factory=dict)
    live: dict[str, torch.Tensor] = field(default_factory=dict)  # kept from the live bundle

    def assemble(self, read: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rank's tensors, cut from the tensors read (their digests checked)."""
        out = dict(self.live)
        for key, spec in self.plain["tensors"].items():
            if key in out:
                continue
            cuts = self.cuts[key]
            source, src, dst = cuts[0]
            if len(cuts) == 1 and tuple(read[source].shape) == tuple(spec["shape"]):
                out[key] = read[source]  # the whole saved tensor
                continue
            tensor = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            for source, src, dst in cuts:
                tensor[dst] = read[source][src]
            out[key] = tensor
        return out


def plan_move(bundle: StateBundle, saved: list[dict[str, Any]], *, rank: int, source: str,
              reseeded_rng: bool, skip_rng: tuple[str, ...] = ()) -> Move:
    """Rank `rank`'s tree, reads and cuts for a load of the saved ranks' trees `saved`."""
    live_tensors, live_plain = collect(bundle, rank)  # this rank's keys, shapes and random states
    for name in _PLAIN_FIELDS:
        _same_on_every_rank(saved, name, source)

    # Tensors (model and optimizer): every saved one, under this rank's key, cut from the
    # saved pieces to this rank's place (its shard's, or the whole tensor).
    pieces = _pieces(saved, source)
    shards = dict(bundle.shards)
    rank_local = set(bundle.rank_local) | set(shards)
    local_shapes = {k: tuple(v["shape"]) for k, v in live_plain["tensors"].items()
                    if k.startswith("model/")}
    live_by_base: dict[str, str] = {}
    manifest: dict[str, dict[str, Any]] = {}
    reads: dict[str, dict[str, Any]] = {}
    cuts = {}
    for base, found in pieces.items():
        section, _, rest = base.partition("/")
        name, slot = (rest, "") if section == "model" else rest.rsplit("/", 1)
        key = f"{section}/{name}@rank{rank}" + (f"/{slot}" if slot else "") if name in rank_local else base
        live_by_base[base] = key
        global_shape = found[0].global_shape
        place = shards.get(name)
        model_key = f"model/{name}@rank{rank}" if name in rank_local else f"model/{name}"
        if place is not None and tuple(place.global_shape) == global_shape and model_key in local_shapes:
            offsets, sizes = tuple(place.offsets), local_shapes[model_key]
        else:
            offsets, sizes = (0,) * len(global_shape), global_shape
        manifest[key] = {"shape": list(sizes), "dtype": found[0].spec["dtype"]}
        if section == "model" and model_key not in local_shapes:
            continue  # not in the live model: `check` names it before anything is read
        cuts[key] = _cut(base, found, global_shape, offsets, sizes, source, rank)
        by_key = {piece.key: piece.spec for piece in found}
        for piece_key, _, _ in cuts[key]:
            reads[piece_key] = by_key[piece_key]

    # The tree of rank 0, its tensor references renamed to this rank's keys.
    def rename(key: str) -> str:
        return live_by_base.get(base_key(key), base_key(key))

    plain = {name: _renamed(saved[0][name], rename) for name in _PLAIN_FIELDS}
    live: dict[str, torch.Tensor] = {}
    if reseeded_rng:  # the live states stay: the tree and tensors of the live bundle
        plain["rng"] = live_plain["rng"]
        for key, spec in live_plain["tensors"].items():
            if key.startswith("rng@"):
                manifest[key], live[key] = dict(spec), live_tensors[key]
    else:
        _same_random_states(saved, source, skip_rng)
        own = f"rng@rank{rank}"
        plain["rng"] = _renamed(saved[0]["rng"], lambda key: own + key[len("rng@rank0"):])
        for key, spec in saved[0]["tensors"].items():
            if key.startswith("rng@rank0/"):
                target = own + key[len("rng@rank0"):]
                manifest[target] = {"shape": list(spec["shape"]), "dtype": spec["dtype"]}
                reads[key] = spec
                cuts[target] = [(key, (), ())]
    plain["tensors"] = manifest
    return Move(plain=plain, reads=reads, cuts=cuts, live=live)


def _pieces(saved: list[dict[str, Any]], source: str) -> dict[str, list[_Piece]]:
    """base key -> its distinct saved pieces (one per place; replicas of a piece, which
    must hold the same bits, counted once)."""
    by_base: dict[str, dict[str, _Piece]] = {}
    unplaced: dict[str, list[_Piece]] = {}  # rank-local without a place: per rank
    for rank, plain in enumerate(saved):
        for key, spec in plain["tensors"].items():
            if key.startswith("rng@"):
                continue
            base = base_key(key)
            placed = "global_shape" in spec
            piece = _Piece(key, rank, spec, tuple(spec.get("global_shape", spec["shape"])),
                           tuple(spec.get("offsets", [0] * len(spec["shape"]))))
            if key != base and not placed:
                unplaced.setdefault(base, []).append(piece)
                continue
            place = (piece.offsets, piece.sizes)
            held = by_base.setdefault(base, {})
            other = held.get(place)
            if other is None:
                held[place] = piece
            elif other.key != key and other.spec.get("digest") != spec.get("digest"):
                raise CheckpointLayoutError(
                    f"{source}: {base} at offsets {list(piece.offsets)} is saved by ranks "
                    f"{other.rank} and {rank} with different bits, so the saved layout's replicas "
                    "of it had drifted apart; a load under another layout could take either: "
                    "load it at the saved layout")
    for base, copies in unplaced.items():
        if base in by_base:  # some pieces have a place, these none: which rows would they be?
            placed = sorted({piece.rank for piece in by_base[base].values()})
            raise CheckpointLayoutError(
                f"{source}: {base} is saved with a place in a global tensor by rank(s) {placed} but "
                f"without one by rank(s) {[piece.rank for piece in copies]}, so those pieces have no "
                "place to be joined at (they are refused, not dropped): the manifest is damaged or the "
                "ranks declared their shards differently. Load it at the saved layout, or save every "
                "rank's piece with its place (StateBundle.shards)")
        digests = {piece.spec.get("digest") for piece in copies}
        shapes = {piece.sizes for piece in copies}
        if len(copies) > 1 and (None in digests or len(digests) > 1 or len(shapes) > 1):
            ranks = [piece.rank for piece in copies]
            raise CheckpointLayoutError(
                f"{source}: {base} is rank-local (saved per rank, by ranks {ranks}) and differs "
                "between them, and the checkpoint records no place in a global tensor for it "
                "(StateBundle.shards), so no rank of another layout knows which part is its: "
                "load it at the saved layout, or save its place with StateBundle.shards")
        first = copies[0]
        by_base.setdefault(base, {})[((0,) * len(first.sizes), first.sizes)] = first
    return {base: list(held.values()) for base, held in by_base.items()}


def _cut(base: str, found: list[_Piece], global_shape: tuple[int, ...], offsets: tuple[int, ...],
         sizes: tuple[int, ...], source: str, rank: int):
    """(saved key, slices of it, slices of the new piece) covering the new piece exactly."""
    saved_global = {piece.global_shape for piece in found}
    if saved_global != {global_shape}:
        raise CheckpointLayoutError(
            f"{source}: {base} is a tensor of global shape {sorted(map(list, saved_global))} in "
            f"the checkpoint, but rank {rank}'s bundle places its piece in one of "
            f"{list(global_shape)}; build the same model (and give StateBundle.shards the global "
            "shape) before loading")
    cuts, covered = [], 0
    for piece in sorted(found, key=lambda p: (p.offsets, p.rank)):
        lo = [max(a, b) for a, b in zip(piece.offsets, offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(piece.offsets, piece.sizes, offsets, sizes)]
        if any(h <= low for low, h in zip(lo, hi)) and math.prod(sizes) > 0:
            continue
        src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, piece.offsets))
        dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets))
        cuts.append((piece.key, src, dst))
        covered += math.prod(h - low for low, h in zip(lo, hi))
    if covered != math.prod(sizes) or (not cuts and math.prod(sizes) > 0) or (
            _overlapping([(piece.offsets, piece.sizes) for piece in found])):
        raise CheckpointLayoutError(
            f"{source}: the saved pieces of {base} ({len(found)} of global shape "
            f"{list(global_shape)}) cover {covered} of the {math.prod(sizes)} elements of rank "
            f"{rank}'s piece at offsets {list(offsets)} (or overlap): they do not tile the tensor, "
            "so its piece cannot be cut from them; load it at the saved layout")
    if not cuts:  # an empty tensor: read its one piece (nothing to copy)
        cuts.append((found[0].key, tuple(slice(0, 0) for _ in sizes), tuple(slice(0, 0) for _ in sizes)))
    return cuts


def _overlapping(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    for i, (a, n) in enumerate(boxes):
        for b, m in boxes[i + 1:]:
            if all(x < y + q and y < x + p for x, p, y, q in zip(a, n, b, m)) and math.prod(n) and math.prod(m):
                return True
    return False


def _renamed(value: Any, rename) -> Any:
    """The JSON tree with each tensor reference {"__tensor__": key} renamed."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR} and isinstance(value[_TENSOR], str):
            return {_TENSOR: rename(value[_TENSOR])}
        return {k: _renamed(v, rename) for k, v in value.items()}
    if isinstance(value, list):
        return [_renamed(v, rename) for v in value]
    return value


def _same_on_every_rank(saved: list[dict[str, Any]], name: str, source: str) -> None:
    """Plain field `name` (tensor references by base key) is the same in every saved tree."""
    first = _renamed(saved[0][name], base_key)
    for rank, plain in enumerate(saved[1:], start=1):
        where = _first_difference(first, _renamed(plain[name], base_key), name)
        if where is not None:
            path, a, b = where
            raise CheckpointLayoutError(
                f"{source}: field {path} is {_short(a)} on saved rank 0 but {_short(b)} on saved "
                f"rank {rank}: state that differs per rank cannot move to another layout (which "
                "rank's would a new rank take?); load it at the saved layout, or keep such state "
                "the same on every rank (a global data position, not a per-rank one)")


def _same_random_states(saved: list[dict[str, Any]], source: str, skip: tuple[str, ...]) -> None:
    """Every random state is the same on every saved rank (tensors by their digests)."""
    def by_digest(plain: dict[str, Any]):
        specs = plain["tensors"]
        return _renamed(plain["rng"], lambda key: f"digest {specs.get(key, {}).get('digest')}"
                        f" of {specs.get(key, {}).get('shape')}")

    def states(tree: Any) -> dict[str, Any]:
        tree = tree if isinstance(tree, dict) else {}
        named = {k: v for k, v in tree.items() if k != "generators"}
        named.update(tree.get("generators", {}) if isinstance(tree.get("generators"), dict) else {})
        return named

    first = states(by_digest(saved[0]))
    differing: dict[str, list[int]] = {}
    for rank, plain in enumerate(saved[1:], start=1):
        mine = states(by_digest(plain))
        for name in sorted(set(first) | set(mine)):
            if name not in skip and (first.get(name) != mine.get(name) or "digest None" in repr(mine.get(name))):
                differing.setdefault(name, []).append(rank)
    if differing:
        names = ", ".join(f"{name} (rank 0 vs {', '.join(map(str, ranks))})"
                          for name, ranks in differing.items())
        raise CheckpointLayoutError(
            f"{source}: random state(s) {names} differ between the saved ranks: per-rank random "
            "streams cannot move to another layout bitwise (a new rank would continue some other "
            "rank's stream). If the program reseeds every draw from a key that does not depend on "
            "the layout (samebits.invariant's micro_batch), pass reseeded_rng=True to keep the "
            "live states; else load it at the saved layout")


def _first_difference(a: Any, b: Any, path: str):
    if type(a) is not type(b):
        return path, a, b
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}.{key}", a.get(key, "(missing)"), b.get(key, "(missing)")
            found = _first_difference(a[key], b[key], f"{path}.{key}")
            if found is not None:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return path, f"a list of {len(a)}", f"a list of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_difference(x, y, f"{path}[{i}]")
            if found is not None:
                return found
        return None
    return None if a == b else (path, a, b)


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."
