"""The checks of a checkpoint's JSON files, meta.json and each rank-<r>.json, each signed with the
sha256 of its content: a field samebits does not write, or of the wrong type, is damage named
by file and field."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from samebits.checkpoint._bundle import DAMAGED, MAX_DEPTH
from samebits.checkpoint._errors import CheckpointError
from samebits.checkpoint._regular import _read_regular

FORMAT = "samebits-checkpoint/3"
# /1: before the checksums and digests; /2: before the save id.  Both load with every check
# their files allow (a /2 checkpoint all but the save id's), and a warning saying so.
_LEGACY_FORMATS = ("samebits-checkpoint/2", "samebits-checkpoint/1")
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
# The most bytes `load` reads of each file (a bigger one is damage, not a checkpoint to OOM on).
_MAX_BYTES = {"meta.json": 1 << 20, "rank": 256 << 20, ".metadata": 256 << 20}
_MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
_RANK_FIELDS = ("progress", "metadata", "optimizer", "lr_scheduler", "rng", "tensors")
_RANK_SAVE_FIELD = "save"  # {"id", "step"}: which save wrote the file (format 3)


def _content_sha256(value: dict[str, Any]) -> str:
    """sha256 of a JSON object's canonical text (sorted keys, no spaces): Python's float repr
    and JSON's numbers round-trip, so it is the same after a load."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _signed(path: Path, value: dict[str, Any], required: bool) -> dict[str, Any]:
    """`value` without its "sha256", which must match the rest (a JSON edit, a flipped digit
    or a lost line that still parses is damage, not another checkpoint)."""
    recorded = value.pop("sha256", None)
    if recorded is None and not required:
        return value
    if recorded != _content_sha256(value):
        raise CheckpointError(f"{path} does not match the sha256 it records for its content "
                              f"({'none recorded' if recorded is None else recorded!r}); "
                              f"{DAMAGED}")
    return value


def _read_json(path: Path, real: Path, limit: int) -> dict[str, Any]:
    data = _read_regular(real, limit, "a checkpoint's JSON file",
                         "load an older step-K directory or save again", shown=path)
    try:
        value = json.loads(data.decode())
    except (ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise CheckpointError(f"{path} is damaged ({type(err).__name__}: {str(err)[:200]}); the "
                              "checkpoint is truncated or corrupt: load an older step-K directory "
                              "or save again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is damaged: it holds a JSON {type(value).__name__}, not "
                              "an object; load an older step-K directory or save again")
    deep = _deeper_than(value, MAX_DEPTH)
    if deep is not None:
        raise CheckpointError(f"{path}: field {deep} is nested deeper than {MAX_DEPTH} levels, "
                              f"which samebits never writes; {DAMAGED}")
    return value


def _deeper_than(value: Any, limit: int) -> str | None:
    """The first field nested deeper than `limit` levels, without recursion (None if none)."""
    stack = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if depth > limit:
            return where or "(the top level)"
        if isinstance(item, dict):
            stack.extend((v, f"{where}.{k}" if where else k, depth + 1) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item))
    return None


_META_FIELDS = {"format": str, "world_size": int, "layout": dict, "step": int,
                "torch_version": str, "digest_version": int, "metadata_sha256": str,
                "save_id": str, "layout_metadata": list}


def _read_meta(path: Path, real: Path) -> dict[str, Any]:
    """meta.json, with the fields `load` relies on checked."""
    meta = _read_json(path, real, _MAX_BYTES["meta.json"])
    if meta.get("format") != FORMAT and meta.get("format") not in _LEGACY_FORMATS:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}; "
                              "this is not a samebits checkpoint of this version")
    version = format_version(meta)
    legacy = version < 2
    required = ["world_size", "layout", "step"] + ([] if legacy else
                                                   ["digest_version", "metadata_sha256"]) + (
        ["save_id", "layout_metadata"] if version >= 3 else [])
    for field_name in required:
        if field_name not in meta:
            raise CheckpointError(f"{path} has no {field_name!r}: it is damaged or was edited; "
                                  "load an older step-K directory or save again")
    for field_name, value in meta.items():
        kind = _META_FIELDS.get(field_name)
        if kind is None and field_name != "sha256":
            raise CheckpointError(f"{path}: field {field_name!r} is not one samebits writes; "
                                  f"{DAMAGED}")
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise CheckpointError(f"{path}: {field_name!r} is {value!r}, not a "
                                  f"{kind.__name__}; the file is damaged: load an older step-K "
                                  "directory or save again")
    if meta["world_size"] < 1 or meta["step"] < 0:
        raise CheckpointError(f"{path}: world_size {meta['world_size']}, step {meta['step']}: "
                              f"not a world size and a step; {DAMAGED}")
    if "save_id" in meta and _SAVE_ID.fullmatch(meta["save_id"]) is None:
        raise CheckpointError(f"{path}: field save_id is {meta['save_id'][:40]!r}, not a save id (32 hex "
                              f"digits); {DAMAGED}")
    if not all(isinstance(p, str) for p in meta.get("layout_metadata", [])):
        raise CheckpointError(f"{path}: field layout_metadata is not a list of dotted paths; {DAMAGED}")
    return _signed(path, meta, required=not legacy)


def format_version(meta: dict[str, Any]) -> int:
    """1, 2 or 3: what the checkpoint's files hold (checksums and digests from 2, the save id
    from 3)."""
    return int(meta["format"].rsplit("/", 1)[1])


def legacy_note(directory: Path, meta: dict[str, Any]) -> str | None:
    """What a checkpoint of an earlier format is not checked for (None for this format)."""
    version = format_version(meta)
    if version >= 3:
        return None
    lacking = "no save id" if version == 2 else "no save id, checksums or tensor digests"
    return (f"{directory} was saved by an earlier samebits ({meta['format']}): its files carry {lacking}, "
            "so a directory mixed from two saves (a rank's files copied from another run) cannot be told "
            "from one save; it loads with every other check. Save it again with this samebits to have it "
            "checked")


def _read_rank_manifest(path: Path, real: Path, rank: int, meta: dict[str, Any]) -> dict[str, Any]:
    """rank-<r>.json, with its fields and tensor manifest checked (`_bundle.check` checks the
    rest against the bundle)."""
    plain = _read_json(path, real, _MAX_BYTES["rank"])
    version = format_version(meta)
    legacy = version < 2
    missing = [name for name in _RANK_FIELDS + ((_RANK_SAVE_FIELD,) if version >= 3 else ())
               if name not in plain]
    if missing or plain.get("rank") != rank:
        what = f"fields {missing}" if missing else f"rank {rank} (it says {plain.get('rank')!r})"
        raise CheckpointError(f"{path} lacks {what}: the file is damaged or was edited; load an "
                              "older step-K directory or save again")
    extra = sorted(set(plain) - set(_RANK_FIELDS) - {"rank", "sha256", _RANK_SAVE_FIELD})
    if extra:
        raise CheckpointError(f"{path}: field {extra[0]!r} is not one samebits writes; {DAMAGED}")
    tensors = plain["tensors"]
    bad = [key for key, spec in tensors.items() if not _is_tensor_spec(spec, legacy)] \
        if isinstance(tensors, dict) else ["(the manifest is not a JSON object)"]
    if bad:
        raise CheckpointError(f"{path} lists tensors without a valid shape and dtype: "
                              f"{bad[:5]}; the file is damaged: load an older step-K directory")
    plain = _signed(path, plain, required=not legacy)
    if version >= 3:
        _check_save(path, plain.pop(_RANK_SAVE_FIELD), rank, meta)
    else:
        plain.pop(_RANK_SAVE_FIELD, None)
    step = plain["progress"].get("step") if isinstance(plain["progress"], dict) else None
    if step != meta["step"] or isinstance(step, bool):
        raise CheckpointError(f"{path}: field progress.step is {step!r}, but meta.json says step "
                              f"{meta['step']}; {DAMAGED}")
    return plain


def _check_save(path: Path, save: Any, rank: int, meta: dict[str, Any]) -> None:
    """The save that wrote rank `rank`'s file is the one meta.json names (the same id and step):
    a file copied in from another run's save, or another save of this step, is refused before
    any tensor is read (its shard's bytes are then checked against this file's digests)."""
    if (not isinstance(save, dict) or set(save) != {"id", "step"} or not isinstance(save["id"], str)
            or _SAVE_ID.fullmatch(save["id"]) is None or not _is_count(save["step"])):
        raise CheckpointError(f"{path}: field save is {_short_json(save)}, not the save's id and step; "
                              f"{DAMAGED}")
    if save["id"] != meta["save_id"] or save["step"] != meta["step"]:
        raise CheckpointError(
            f"{path}: rank {rank}'s file was written by save {save['id']} of step {save['step']}, but "
            f"{path.parent / 'meta.json'} by save {meta['save_id']} of step {meta['step']}: the directory "
            f"mixes files of two saves (rank {rank}'s files copied from another run, or from another "
            "save of this step), and loading it would give some ranks another run's state. Load a "
            "directory whose files all come from one save (an older step-K directory), or save again")


def _short_json(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_tensor_spec(spec: Any, legacy: bool) -> bool:
    """shape, dtype, a digest (format 2) and, for a piece of a global tensor, its place
    (global_shape and offsets, holding the piece)."""
    placed = isinstance(spec, dict) and ("global_shape" in spec or "offsets" in spec)
    return (isinstance(spec, dict)
            and set(spec) <= {"shape", "dtype", "digest", "global_shape", "offsets"}
            and isinstance(spec.get("shape"), list) and len(spec["shape"]) <= _MAX_DIMS
            and all(_is_count(n) for n in spec["shape"])
            and (not placed or _is_place(spec["shape"], spec.get("global_shape"), spec.get("offsets")))
            and isinstance(spec.get("dtype"), str)
            and isinstance(getattr(torch, spec["dtype"], None), torch.dtype)
            and ("digest" not in spec or (not legacy and isinstance(spec["digest"], str)
                                          and re.fullmatch(r"[0-9a-f]{16}", spec["digest"]) is not None)))


def _is_place(shape: list, global_shape: Any, offsets: Any) -> bool:
    return (isinstance(global_shape, list) and isinstance(offsets, list)
            and len(global_shape) == len(shape) == len(offsets)
            and all(_is_count(n) for n in (*global_shape, *offsets))
            and all(o + n <= g for o, n, g in zip(offsets, shape, global_shape)))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_dims(value: Any) -> bool:
    """A torch.Size (or tuple) of at most 64 non-negative ints: a shape or chunk offsets."""
    return (isinstance(value, (torch.Size, tuple)) and len(value) <= _MAX_DIMS
            and all(_is_count(n) for n in value))
