"""On-disk checkpoints: `save` and `load` (docs/checkpoint.md, "On disk" to "All or nothing").
The commit is `_commit`; the checks of the files `_regular`, `_manifests` and `_dcp_metadata`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from samebits._torchutil import group_rank_and_world_size
from samebits.checkpoint._bundle import StateBundle, apply, check, check_loaded, collect, declared_places, empty_tensors
from samebits.checkpoint._commit import _commit, _finish_or_remove_interrupted_commits, _fsync_dir, resolve
from samebits.checkpoint._dcp_metadata import (_check_dcp_metadata, _read_dcp_metadata, _safe_reader,
                                               _tensor_only_planner)
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError
from samebits.checkpoint._layout import plan_move
from samebits.checkpoint._manifests import (_RANK_SAVE_FIELD, FORMAT, _content_sha256, _read_meta,
                                            _read_rank_manifest, format_version, legacy_note)
from samebits.errors import ConfigError, SamebitsError
from samebits.fingerprint import DIGEST_VERSION, DTYPE_CODES, digest_many

#: Test-only switches (environment variables), read at save/load time.
DROP_RNG_ENV = "SAMEBITS_TEST_DROP_RNG"  # comma-separated random states `load` leaves out
SAVE_PAUSE_ENV = "SAMEBITS_TEST_SAVE_PAUSE_S"  # sleep after the shards, before the commit


def save(path: str | os.PathLike, bundle: StateBundle) -> Path:
    """Save the bundle of every rank as ROOT/step-K (K = bundle.progress["step"]); collective.
    Returns the committed directory once every rank can see it."""
    if "step" not in bundle.progress:
        raise CheckpointError('bundle.progress has no "step": set it to the next step to run')
    if isinstance(bundle.layout_metadata, str) or not all(isinstance(p, str) for p in bundle.layout_metadata):
        raise ConfigError(f"StateBundle.layout_metadata is {bundle.layout_metadata!r}; give a list of dotted paths "
                          'into metadata, e.g. ["config.tp"]')
    rank, world_size = group_rank_and_world_size()
    root = Path(path)
    step = int(bundle.progress["step"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _finish_or_remove_interrupted_commits(root)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir()
    # One id for this save, on every rank (the broadcast also waits for rank 0's directory):
    # each rank's file records it, so a directory mixed from two saves is refused by name.
    save_id = _broadcast_from_rank0(uuid.uuid4().hex if rank == 0 else None, world_size)

    tensors, plain = collect(bundle, rank)
    digests = _digests(tensors)
    for key, value in digests.items():
        plain["tensors"][key]["digest"] = f"{value:016x}"
    if world_size > 1:
        _check_shared_tensors(digests, rank)
    import torch.distributed.checkpoint as dcp  # here: importing it takes ~0.6 s

    with _quiet_single_process():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 no_dist=world_size == 1)
    pause = float(os.environ.get(SAVE_PAUSE_ENV, "0") or 0)
    if pause > 0:
        print(f"samebits.checkpoint: rank {rank} wrote its shards to {tmp}; pausing {pause} s "
              f"before the commit ({SAVE_PAUSE_ENV})", file=sys.stderr, flush=True)
        time.sleep(pause)
    _write_json(tmp / f"rank-{rank}.json", {"rank": rank, _RANK_SAVE_FIELD: {"id": save_id, "step": step},
                                            **plain})
    _barrier(world_size)

    if rank == 0:
        _write_json(tmp / "meta.json", {
            "format": FORMAT, "world_size": world_size, "layout": dict(bundle.layout),
            "step": step, "torch_version": torch.__version__, "digest_version": DIGEST_VERSION,
            "metadata_sha256": hashlib.sha256((tmp / ".metadata").read_bytes()).hexdigest(),
            "save_id": save_id, "layout_metadata": sorted(bundle.layout_metadata),
        })
        _fsync_dir(tmp)
        _commit(root, tmp, final)
    _barrier(world_size)
    return final


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """key -> digest of each plain tensor (`load` checks what it reads against them; DTensors
    and other tensor subclasses, whose bits DCP lays out itself, and dtypes the digest does
    not cover have none)."""
    plain = {key: t for key, t in tensors.items()
             if (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.dtype in DTYPE_CODES}
    return dict(zip(plain, digest_many(plain.values()))) if plain else {}


def _broadcast_from_rank0(value: Any, world_size: int) -> Any:
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _check_shared_tensors(digests: dict[str, int], rank: int) -> None:
    """Refuse, on every rank, to save a tensor that is not rank-local but differs between ranks:
    DCP stores rank 0's copy only, so a resume would hide replicas that drifted apart.  Tensors
    one rank holds and those `_digests` skips are not compared.  One small all-gather."""
    mine = {key: value for key, value in digests.items() if "@rank" not in key}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    differing = []
    for key in sorted(set().union(*gathered)):
        holders = {r: theirs[key] for r, theirs in enumerate(gathered) if key in theirs}
        if len(set(holders.values())) > 1:
            first = min(holders)
            odd = [r for r, value in holders.items() if value != holders[first]]
            differing.append(f"{key} (rank {first} vs rank{'s' if len(odd) > 1 else ''} "
                             f"{', '.join(map(str, odd))})")
    if differing:
        more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
        raise CheckpointError(
            f"rank {rank}: {len(differing)} tensor(s) that the checkpoint stores once differ between ranks: "
            f"{'; '.join(differing[:5])}{more}. A resume would give every rank rank 0's copy. If such a tensor is "
            "meant to differ per rank (a shard, a per-rank buffer), list it in StateBundle.rank_local; if it is a "
            "replica, the replicas drifted apart (samebits.check_replicas names them at any step): find why "
            "before saving.")


def load(path: str | os.PathLike, bundle: StateBundle, *, allow_layout_change: bool = False,
         reseeded_rng: bool = False) -> Path:
    """Load into the bundle in place; `path` is a root (follows `latest`) or a step-K dir.
    Returns the directory it loaded.

    Collective, like `save`.  Another world size or layout is a `CheckpointLayoutError` unless
    `allow_layout_change` (docs/checkpoint.md, "Load under another layout"; `reseeded_rng`
    keeps the live random states there); the change is set on `bundle.layout_change`.  All or
    nothing on every rank: anything wrong is a `CheckpointError` before any bundle changes, and
    one rank's refusal is every rank's.
    """
    rank, world_size = group_rank_and_world_size()
    with _agreed(rank, world_size, "before reading the shards"):
        planned = _plan_load(path, bundle, rank, world_size, allow_layout_change, reseeded_rng)
    directory, meta, move = planned.directory, planned.meta, planned.move
    tensors = _read_shards(planned, rank, world_size)
    with _agreed(rank, world_size, "after reading the shards"):
        if format_version(meta) >= 2:
            _check_digests(tensors, planned.reads, meta, planned.rank_path, directory)
        if move is not None:
            tensors = move.assemble(tensors)
        check_loaded(bundle, tensors, planned.plan)
    if planned.skip:
        print(f"samebits.checkpoint: rank {rank} leaves out random state(s) {', '.join(planned.skip)} "
              f"on purpose ({DROP_RNG_ENV}); the resume will not be bitwise",
              file=sys.stderr, flush=True)
    apply(bundle, tensors, planned.plan)
    bundle.layout_change = None
    if move is not None:
        bundle.layout_change = {"step": meta["step"],
                                "from": {"world_size": meta["world_size"], "layout": meta["layout"]},
                                "to": {"world_size": world_size, "layout": dict(bundle.layout)}}
        if rank == 0:
            print(f"samebits.checkpoint: loaded {directory} (saved at world_size="
                  f"{meta['world_size']}, layout {meta['layout']}) at world_size={world_size}, layout "
                  f"{dict(bundle.layout)}: a layout change (allow_layout_change"
                  f"{', reseeded_rng: the live random states kept' if reseeded_rng else ''})",
                  file=sys.stderr, flush=True)
    return directory


@dataclasses.dataclass
class _Planned:
    """What `load` reads and how, every file but the shards checked (`_plan_load`)."""

    directory: Path
    real: Path  # the directory with links resolved: files are opened under it, never through a link
    meta: dict[str, Any]
    rank_path: Path  # the rank file named in errors (rank-0.json at a layout change)
    reads: dict[str, Any]  # the tensor manifest of what this rank reads
    plan: Any  # `_bundle.check`'s plan for applying what is read
    metadata: Any  # DCP's metadata, checked and cut to this rank's tensors
    move: Any  # `_layout.plan_move`'s plan at a layout change, else None
    skip: list[str]  # random states left out on purpose (DROP_RNG_ENV)


def _plan_load(path, bundle: StateBundle, rank: int, world_size: int, allow_layout_change: bool,
               reseeded_rng: bool) -> _Planned:
    """Check every file of the checkpoint ``path`` names but the shards, and plan the load."""
    move = None
    directory = resolve(path)
    real = Path(os.path.realpath(directory))  # files are opened without following links
    meta = _read_meta(directory / "meta.json", real / "meta.json")
    moved = meta["world_size"] != world_size or meta["layout"] != dict(bundle.layout)
    if moved and not allow_layout_change:
        raise CheckpointLayoutError(
            f"{directory} was saved with world_size={meta['world_size']} and layout "
            f"{meta['layout']}, but rank {rank} loads it with world_size={world_size} and "
            f"layout {dict(bundle.layout)}; resume with the saved world size and layout "
            "(per-rank random states and shards cannot be moved bitwise), or, where the state "
            "allows it, opt in with allow_layout_change=True (docs/checkpoint.md)")
    skip = [name.strip() for name in os.environ.get(DROP_RNG_ENV, "").split(",") if name.strip()]
    if not moved:
        rank_path = directory / f"rank-{rank}.json"
        plain = _read_rank_manifest(rank_path, real / rank_path.name, rank, meta)
        reads = plain["tensors"]
        # The places this rank's bundle declares must be the places it saved: at the same
        # layout each rank reads its own pieces, which are its rows only if it still holds
        # the place it held.  Opted in, pieces are cut by place instead (as at a layout change).
        moved = _places_differ(bundle, plain, rank, rank_path, meta, refuse=not allow_layout_change)
    if moved:
        rank_path = directory / "rank-0.json"
        saved = [_read_rank_manifest(directory / f"rank-{r}.json", real / f"rank-{r}.json", r, meta)
                 for r in range(meta["world_size"])]
        move = plan_move(bundle, saved, rank=rank, source=str(directory),
                         reseeded_rng=reseeded_rng, skip_rng=tuple(skip))
        plain, reads = move.plain, move.reads
    source = str(rank_path) if move is None else (
        f"{directory} (saved at world_size={meta['world_size']}, loaded by rank {rank} of {world_size})")
    plan = check(bundle, plain, rank=rank, source=source, skip_rng=skip)
    note = legacy_note(directory, meta)
    if note is not None and rank == 0:
        warnings.warn(note, stacklevel=4)  # as from load (stacklevel 3), one frame deeper
    metadata = _read_dcp_metadata(directory / ".metadata", real / ".metadata", meta)
    metadata = _check_dcp_metadata(directory / ".metadata", real, metadata, reads, rank_path)
    return _Planned(directory, real, meta, rank_path, reads, plan, metadata, move, skip)


def _read_shards(planned: _Planned, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """The tensors of the plan, read from the shards through the checked metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tensors = empty_tensors({"tensors": planned.reads})
    try:  # collective: DCP raises on every rank when one fails
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=_safe_reader(planned.real, planned.metadata),
                     planner=_tensor_only_planner(), no_dist=world_size == 1)
    except (Exception, CheckpointException) as err:  # DCP wraps what a damaged shard raises
        raise CheckpointError(f"{planned.directory}: rank {rank} could not read its tensors ({err}); "
                              "the shards are damaged or incomplete: load an older step") from err
    return tensors


def _places_differ(bundle: StateBundle, plain: dict[str, Any], rank: int, rank_path: Path,
                   meta: dict[str, Any], *, refuse: bool) -> bool:
    """Whether the places `bundle.shards` declares for this rank's model tensors differ from
    the places rank-<r>.json recorded; when they do and `refuse`, a CheckpointLayoutError naming
    the tensor and both places."""
    declared = declared_places(bundle, rank)
    for key, spec in plain["tensors"].items():
        if not key.startswith("model/") or key not in declared:
            continue  # a name the bundle lacks: `check` names it
        saved = (spec["global_shape"], spec["offsets"]) if "global_shape" in spec else None
        live = declared[key]
        if saved == live:
            continue
        if not refuse:
            return True

        def said(place):
            return ("no place in a global tensor" if place is None
                    else f"offsets {place[1]} of a global tensor of shape {place[0]}")

        raise CheckpointLayoutError(
            f"{rank_path}: rank {rank} saved {key} with {said(saved)}, but rank {rank}'s bundle "
            f"declares {said(live)} (StateBundle.shards), at the same world size "
            f"({meta['world_size']}) and layout {meta['layout']}: loading it would give this rank "
            "the values of another place. Declare the places the saved run declared, or pass "
            "allow_layout_change=True to cut each rank's piece from the saved pieces by place")
    return False


def saved_layout(path: str | os.PathLike) -> dict[str, Any]:
    """{"directory", "step", "world_size", "layout"} of the checkpoint `path` names (a root's
    latest or a step-K directory), from its checked meta.json: what a resume at another
    layout changes from, known before anything is built."""
    directory = resolve(path)
    meta = _read_meta(directory / "meta.json", Path(os.path.realpath(directory)) / "meta.json")
    return {"directory": str(directory), "step": meta["step"], "world_size": meta["world_size"],
            "layout": meta["layout"]}


@contextlib.contextmanager
def _agreed(rank: int, world_size: int, when: str):
    """Run the block's checks on every rank, then agree (one all-gather): if any rank refused,
    every rank raises, the others with a `CheckpointError` naming that rank and its reason."""
    mine = None
    try:
        yield
    except SamebitsError as err:
        mine = err
    if world_size > 1:
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, None if mine is None else f"{type(mine).__name__}: {mine}")
        refused = [(r, reason) for r, reason in enumerate(gathered) if reason is not None]
        if refused and mine is None:
            other, reason = refused[0]
            raise CheckpointError(f"rank {other} refused the checkpoint {when} ({reason}), so "
                                  f"rank {rank} leaves its bundle as it was too")
    if mine is not None:
        raise mine


def _check_digests(tensors: dict[str, torch.Tensor], manifest: dict[str, Any], meta: dict[str, Any],
                   rank_path: Path, directory: Path) -> None:
    """Every tensor read has the bits `save` digested (a garbled shard reads as other values)."""
    if meta["digest_version"] != DIGEST_VERSION:
        warnings.warn(f"{directory} records tensor digests of version {meta['digest_version']}; "
                      f"this samebits computes version {DIGEST_VERSION}, so the tensors read are "
                      "not checked against them", stacklevel=3)
        return
    keys = [key for key, spec in manifest.items() if "digest" in spec]
    for key, value in zip(keys, digest_many([tensors[key] for key in keys]) if keys else ()):
        if f"{value:016x}" != manifest[key]["digest"]:
            raise CheckpointError(
                f"tensor {key!r}: the bits read from the shards of {directory} have digest "
                f"{value:016x}, but {rank_path} records {manifest[key]['digest']} for it; the "
                "shard is damaged: load an older step-K directory")


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns on every single-process save/load, even when asked for one (no_dist)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _write_json(path: Path, value: Any) -> None:
    """Write `value` with the sha256 of its content (`_signed`), fsync'd."""
    parsed = json.loads(json.dumps(value))  # as `load` will see it (tuples as lists, ...)
    with open(path, "w") as file:
        json.dump({**parsed, "sha256": _content_sha256(parsed)}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
