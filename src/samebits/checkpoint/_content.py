"""A checkpoint's training state, hashed alike at any layout (docs/checkpoint.md, "The training
state's hashes, at any layout"); one process reads every rank's part."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from samebits.checkpoint._bundle import _TENSOR, empty_tensors
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError
from samebits.checkpoint._layout import _cut, _pieces, _renamed, _same_on_every_rank, base_key
from samebits.checkpoint._commit import resolve
from samebits.checkpoint._dcp_metadata import (_check_dcp_metadata, _read_dcp_metadata, _safe_reader,
                                               _tensor_only_planner)
from samebits.checkpoint._manifests import _read_meta, _read_rank_manifest, format_version
from samebits.checkpoint._storage import _check_digests, _quiet_single_process

PROGRESS_FIELDS = ("step", "consumed_samples")  # the global progress the content hash covers
#: The parts of the resumable state `state_sha256` covers beyond the content, in its order.
STATE_PARTS = ("progress", "optimizer", "lr_scheduler", "metadata", "rng")


def content_sha256(path: str | os.PathLike) -> dict[str, Any]:
    """{"sha256", "state_sha256", "state_parts", "step", "tensors", "elements", "world_size"} of the
    checkpoint ``path`` names: the hashes of its training state and of its whole resumable state,
    the same at any layout (docs/checkpoint.md).  What has no one global value is a
    `CheckpointLayoutError`; a damaged or mixed checkpoint a `CheckpointError`.
    """
    directory = resolve(path)
    real = Path(os.path.realpath(directory))
    meta = _read_meta(directory / "meta.json", real / "meta.json")
    saved = [_read_rank_manifest(directory / f"rank-{r}.json", real / f"rank-{r}.json", r, meta)
             for r in range(meta["world_size"])]
    source = str(directory)
    _same_on_every_rank(saved, "progress", source)
    pieces = _pieces(saved, source)  # base key -> its distinct pieces (refuses drifted replicas)
    # Every saved piece is read (replicas too, to compare their bytes), and rank 0's random states.
    reads = {key: spec for plain in saved for key, spec in plain["tensors"].items() if not key.startswith("rng@")}
    reads.update({key: spec for key, spec in saved[0]["tensors"].items() if key.startswith("rng@")})
    metadata = _read_dcp_metadata(directory / ".metadata", real / ".metadata", meta)
    metadata = _check_dcp_metadata(directory / ".metadata", real, metadata, reads, directory / "meta.json")
    import torch.distributed.checkpoint as dcp  # here: importing it takes ~0.6 s

    tensors = empty_tensors({"tensors": reads})
    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=_safe_reader(real, metadata), planner=_tensor_only_planner(),
                     no_dist=True)
    except Exception as err:  # DCP wraps what a damaged shard raises
        raise CheckpointError(f"{directory}: could not read its tensors ({err}); the shards are damaged or "
                              "incomplete: hash an older step") from err
    if format_version(meta) >= 2:
        _check_digests(tensors, reads, meta, directory / "meta.json", directory)
    _same_replicas(saved, pieces, tensors, source)

    total = hashlib.sha256()
    elements = 0
    for base in sorted(pieces):
        found = pieces[base]
        shape = found[0].global_shape
        cuts = _cut(base, found, shape, (0,) * len(shape), shape, source, 0)
        value = torch.empty(shape, dtype=getattr(torch, found[0].spec["dtype"]))
        for key, src, dst in cuts:
            value[dst] = tensors[key][src]
        header = json.dumps([base, found[0].spec["dtype"], list(shape)])
        total.update(header.encode() + b"\0")
        total.update(_bytes(value))
        elements += value.numel()
    progress = saved[0]["progress"]
    covered = {name: progress.get(name) for name in PROGRESS_FIELDS}
    total.update(json.dumps(covered, sort_keys=True).encode())
    content = total.hexdigest()

    parts = _state_parts(saved, tensors, meta, source)
    state = hashlib.sha256(content.encode())
    for name in STATE_PARTS:
        state.update(b"\0" + name.encode() + b"\0" + parts[name].encode())
    return {"sha256": content, "state_sha256": state.hexdigest(), "state_parts": parts, "step": meta["step"],
            "tensors": len(pieces), "elements": elements, "world_size": meta["world_size"]}


def _bytes(value: torch.Tensor) -> bytes:
    return value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_replicas(saved: list[dict[str, Any]], pieces, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Every saved piece holds the bytes of the piece `_pieces` keeps for its place, compared by
    value (the first format records no digests): no saved piece is left out of the hash unread."""
    kept = {}
    for base, found in pieces.items():
        for piece in found:
            kept[(base, piece.offsets, piece.sizes)] = piece
    for rank, plain in enumerate(saved):
        for key, spec in plain["tensors"].items():
            if key.startswith("rng@"):
                continue
            base = base_key(key)
            offsets = tuple(spec.get("offsets", [0] * len(spec["shape"])))
            piece = kept.get((base, offsets, tuple(spec["shape"])))
            if piece is None:  # an unplaced rank-local copy: `_pieces` keeps the first and
                piece = pieces[base][0]  # compares the others by digest; compare bytes too
            if piece.key != key and _bytes(tensors[piece.key]) != _bytes(tensors[key]):
                raise CheckpointLayoutError(
                    f"{source}: {base} at offsets {list(offsets)} is saved by ranks {piece.rank} and {rank} "
                    "with different bits, so the saved layout's replicas of it had drifted apart: it has "
                    "no one global value; load it at the saved layout")


def _state_parts(saved: list[dict[str, Any]], tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                 source: str) -> dict[str, str]:
    """The SHA-256 of each part of the resumable state beyond the tensors, each the same for
    the same state saved at any layout (`STATE_PARTS`)."""
    def digest(value: Any) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    _same_on_every_rank(saved, "lr_scheduler", source)
    metadata = [_without(plain["metadata"], meta.get("layout_metadata", [])) for plain in saved]
    _same_on_every_rank([{"metadata": m} for m in metadata], "metadata", source)

    # Optimizer: each parameter's group settings and plain state (tensors are the content's),
    # by parameter name, so the grouping and the ranks that hold a parameter do not matter.
    settings: dict[str, Any] = {}
    holder: dict[str, int] = {}
    for rank, plain in enumerate(saved):
        optimizer = plain["optimizer"]
        if optimizer is None:
            continue
        per_param: dict[str, Any] = {}
        for group in optimizer.get("param_groups", []):
            rest = {k: v for k, v in group.items() if k != "params"}
            for name in group.get("params", []):
                per_param[name] = {"settings": rest}
        for name, entry in (optimizer.get("state") or {}).items():
            plain_state = {k: v for k, v in entry.items() if not (isinstance(v, dict) and _TENSOR in v)}
            per_param.setdefault(name, {})["state"] = plain_state
        for name, value in per_param.items():
            if name in settings and settings[name] != value:
                raise CheckpointLayoutError(
                    f"{source}: the optimizer settings of parameter {name} differ between saved ranks "
                    f"{holder[name]} and {rank}: it has no one resumable state; load it at the saved layout")
            settings.setdefault(name, value)
            holder.setdefault(name, rank)

    # Rank 0's random states, each tensor by the SHA-256 of its bytes.
    rng = _renamed(saved[0]["rng"], lambda key: "sha256:" + hashlib.sha256(_bytes(tensors[key])).hexdigest()
                   if key in tensors else "missing")
    return {"progress": digest(saved[0]["progress"]), "optimizer": digest(settings),
            "lr_scheduler": digest(saved[0]["lr_scheduler"]), "metadata": digest(metadata[0]), "rng": digest(rng)}


def _without(metadata: Any, paths: list[str]) -> Any:
    """`metadata` with the entries at the dotted `paths` removed (where they exist)."""
    value = copy.deepcopy(metadata)
    for path in paths:
        *parents, last = path.split(".")
        node = value
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return value


__all__ = ["content_sha256", "PROGRESS_FIELDS", "STATE_PARTS"]
