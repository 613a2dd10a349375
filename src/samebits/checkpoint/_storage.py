"""On-disk checkpoints: DCP shards written into a temporary directory, committed by rename.

Layout of a checkpoint root:

    ROOT/latest                 "step-K": the last committed checkpoint (replaced atomically)
    ROOT/step-K/.metadata       DCP metadata (written by rank 0)
    ROOT/step-K/__<r>_0.distcp  DCP shards (each rank writes its own)
    ROOT/step-K/rank-<r>.json   rank r's plain values and tensor manifest
    ROOT/step-K/meta.json       format, world size, layout, step (written last, by rank 0)

A save writes into ROOT/.tmp-step-K, fsyncs every file, then rank 0 commits it (`_commit`):
at every instant `latest` names a complete checkpoint, also while a step that `latest`
names is saved again.  A process killed anywhere leaves dot-directories that nothing reads
unless `latest` names them; the next save finishes or removes them.

Loading never unpickles arbitrary objects: tensors go through DCP's `weights_only` reader,
DCP's metadata through an unpickler that only accepts DCP's own metadata classes and is
then checked to describe tensors only (DCP would `torch.load(weights_only=False)` any entry
declared as bytes), and everything else is JSON, checked for the fields samebits writes.

Loading is all or nothing.  Only regular files inside the checkpoint directory are opened
(`O_NOFOLLOW`, `S_ISREG`, a size bound each: no symlink out, no FIFO, no 3 GiB `latest`);
every JSON file carries the sha256 of its content and meta.json that of `.metadata`; every
tensor's chunks must tile it exactly (DCP would leave an uncovered element as `torch.empty`
left it) inside the shard files' sizes; each tensor read is checked against the digest
`save` recorded; and every field is checked before the live bundle changes (`_bundle`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import io
import json
import math
import os
import pickle
import re
import shutil
import stat
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from samebits._torchutil import group_rank_and_world_size
from samebits.fingerprint import DIGEST_VERSION, DTYPE_CODES, digest_many
from samebits.checkpoint._bundle import (DAMAGED, MAX_DEPTH, StateBundle, apply, check,
                                         check_loaded, collect, declared_places, empty_tensors)
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError
from samebits.checkpoint._layout import plan_move
from samebits.errors import ConfigError, SamebitsError

FORMAT = "samebits-checkpoint/3"
# /1: before the checksums and digests; /2: before the save id.  Both load with every check
# their files allow (a /2 checkpoint all but the save id's), and a warning saying so.
_LEGACY_FORMATS = ("samebits-checkpoint/2", "samebits-checkpoint/1")
_SAVE_ID = re.compile(r"[0-9a-f]{32}")
LATEST = "latest"

# The most bytes `load` reads of each file (a bigger one is damage, not a checkpoint to OOM on).
_MAX_BYTES = {LATEST: 4096, "meta.json": 1 << 20, "rank": 256 << 20, ".metadata": 256 << 20}
_MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
_MAX_CHUNKS = 1024  # per tensor; samebits writes one (DCP one per shard of a DTensor)

# Directories of a commit in progress (see `_commit`); only `latest` can make one of them live.
_STAGED, _ASIDE, _LINKED = ".staged-", ".old-", ".link-"
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's FileSystemWriter names: __<rank>_<n>.distcp
_RANK_FIELDS = ("progress", "metadata", "optimizer", "lr_scheduler", "rng", "tensors")
_RANK_SAVE_FIELD = "save"  # {"id", "step"}: which save wrote the file (format 3)

#: Test-only switches (environment variables), read at save/load time.
DROP_RNG_ENV = "SAMEBITS_TEST_DROP_RNG"  # comma-separated random states `load` leaves out
SAVE_PAUSE_ENV = "SAMEBITS_TEST_SAVE_PAUSE_S"  # sleep after the shards, before the commit


def save(path: str | os.PathLike, bundle: StateBundle) -> Path:
    """Save the bundle of every rank as ROOT/step-K (K = bundle.progress["step"]).

    Collective: every rank of the default process group calls it with its own bundle.
    Returns the committed directory once every rank can see it.
    """
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
    """Refuse, on every rank, to save a tensor that is not rank-local but differs between ranks.

    DCP stores one copy of such a tensor (rank 0's), so a resume would give every rank rank 0's
    value and the run would change at the resume: replicas that drifted apart (a missing
    gradient all-reduce did exactly that once) must be found here, not after the resume.  A
    tensor held by one rank only (a pipeline stage's), DTensors (DCP saves their shards) and
    other tensor subclasses (their layout is theirs to save) are not compared: `_digests`
    gives them none.  One small all-gather of the digests `save` records anyway."""
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


def _commit(root: Path, complete: Path, final: Path) -> None:
    """Make the complete checkpoint directory `complete` ROOT/step-K (`final`) and point
    `latest` at it, so that at every instant `latest` names a complete checkpoint.

    A new step is one atomic rename, then `latest` is replaced.  A step that exists already
    (perhaps the one `latest` names) cannot be replaced by one rename: POSIX renames a
    directory only onto an empty one.  So the new directory is staged under its own name and
    `latest` points there first; the old one is moved aside; a hard-linked copy of the staged
    one (no data copied) is renamed to step-K; `latest` points at step-K; the rest is removed.
    A kill at any point leaves `latest` naming the old or the new checkpoint, whole, and the
    next save finishes the job (`_finish_or_remove_interrupted_commits`).
    """
    staged = complete.name.startswith(_STAGED)
    if not final.exists() and not staged:
        os.rename(complete, final)
        _fsync_dir(root)
        _set_latest(root, final.name)
        return
    token = uuid.uuid4().hex[:12]
    if not staged:
        complete = _rename(complete, root / f"{_STAGED}{final.name}-{token}")
    _set_latest(root, complete.name)
    aside = _rename(final, root / f"{_ASIDE}{final.name}-{token}") if final.exists() else None
    linked = root / f"{_LINKED}{final.name}-{token}"
    shutil.copytree(complete, linked, copy_function=_link_or_copy)
    _fsync_dir(linked)
    _rename(linked, final)
    _set_latest(root, final.name)
    shutil.rmtree(complete)
    if aside is not None:
        shutil.rmtree(aside)


def _finish_or_remove_interrupted_commits(root: Path) -> None:
    """Run by rank 0 before a save: a commit killed after `latest` named its staged directory
    is finished; every other directory a killed save left (.tmp-, .staged-, .old-, .link-) is
    removed, as nothing reads it."""
    try:
        live = _latest_name(root)
    except CheckpointError:
        live = None  # unreadable: this save replaces it, and nothing else is live
    if live is not None and live.startswith(_STAGED) and (root / live / "meta.json").is_file():
        target = live[len(_STAGED):].rsplit("-", 1)[0]  # ".staged-step-K-<token>" -> "step-K"
        _commit(root, root / live, root / target)
        live = target
    for entry in root.iterdir():
        if (entry.name.startswith((".tmp-", _STAGED, _ASIDE, _LINKED)) and entry.name != live
                and entry.is_dir() and not entry.is_symlink()):
            shutil.rmtree(entry)


def _rename(source: Path, target: Path) -> Path:
    os.rename(source, target)
    _fsync_dir(target.parent)
    return target


def _link_or_copy(source: str, target: str) -> None:
    """Hard link (the files of a committed checkpoint are never written again); a copy where
    the file system has no hard links."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
        _fsync_file(Path(target))


def _set_latest(root: Path, name: str) -> None:
    """Point ROOT/latest at `name` atomically: write a temporary file, fsync, os.replace."""
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(f"{name}\n")
    _fsync_file(latest_tmp)
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def _latest_name(root: Path) -> str | None:
    """The directory name ROOT/latest holds (None without one), refused unless it is one
    plain name of an entry inside ROOT.  `latest` itself must be a regular file (a symlink
    could lead anywhere, a FIFO would block the load) of at most a few KiB."""
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        return None
    data = _read_regular(pointer, _MAX_BYTES[LATEST], "a checkpoint's `latest`",
                         f"write the name of a step-K directory into {pointer}, or load a "
                         "step-K directory")
    try:
        name = data.decode().strip()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{pointer} cannot be read ({err}); write the name of a "
                              "step-K directory into it, or load a step-K directory") from None
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or "\n" in name or Path(name).name != name):
        raise CheckpointError(f"{pointer} holds {name!r}, which is not the name of a directory "
                              f"inside {root}; a checkpoint's `latest` names one of its own "
                              "step-K directories: fix the file or load a step-K directory")
    return name


def load(path: str | os.PathLike, bundle: StateBundle, *, allow_layout_change: bool = False,
         reseeded_rng: bool = False) -> Path:
    """Load into the bundle in place; `path` is a root (follows `latest`) or a step-K dir.

    Collective, like `save`.  A checkpoint written by another world size or layout is refused
    (CheckpointLayoutError) unless `allow_layout_change`: then replicated state goes to every
    rank, each rank's piece of a sharded tensor (`StateBundle.shards`) is cut from the saved
    pieces, random states the same on every saved rank are restored, and what cannot move
    (per-rank values and random streams, rank-local tensors without a place) is refused by
    name (`_layout`).  `reseeded_rng` (at a layout change only; at the saved layout every
    state is restored): the program reseeds every draw from a key that does not depend on
    the layout, so the live random states stay.
    The change is set on `bundle.layout_change` and said on stderr (rank 0).

    All or nothing, on every rank: anything wrong with the checkpoint is a `CheckpointError`
    naming the file (and field) before any bundle changes, and the ranks agree before
    reading the shards and before applying, so one rank's refusal is every rank's (none
    waits in a collective for a rank that gave up).  Returns the directory it loaded.
    """
    rank, world_size = group_rank_and_world_size()
    move = None
    with _agreed(rank, world_size, "before reading the shards"):
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
        skip = [name.strip() for name in os.environ.get(DROP_RNG_ENV, "").split(",")
                if name.strip()]
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
            warnings.warn(note, stacklevel=3)
        metadata = _read_dcp_metadata(directory / ".metadata", real / ".metadata", meta)
        metadata = _check_dcp_metadata(directory / ".metadata", real, metadata, reads, rank_path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tensors = empty_tensors({"tensors": reads})
    try:  # collective: DCP raises on every rank when one fails
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=_safe_reader(real, metadata),
                     planner=_tensor_only_planner(), no_dist=world_size == 1)
    except (Exception, CheckpointException) as err:  # DCP wraps what a damaged shard raises
        raise CheckpointError(f"{directory}: rank {rank} could not read its tensors ({err}); "
                              "the shards are damaged or incomplete: load an older step") from err
    with _agreed(rank, world_size, "after reading the shards"):
        if format_version(meta) >= 2:
            _check_digests(tensors, reads, meta, rank_path, directory)
        if move is not None:
            tensors = move.assemble(tensors)
        check_loaded(bundle, tensors, plan)
    if skip:
        print(f"samebits.checkpoint: rank {rank} leaves out random state(s) {', '.join(skip)} "
              f"on purpose ({DROP_RNG_ENV}); the resume will not be bitwise",
              file=sys.stderr, flush=True)
    apply(bundle, tensors, plan)
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


def resolve(path: str | os.PathLike) -> Path:
    """The committed checkpoint directory `path` names (a step-K dir, or a root's latest)."""
    path = Path(path)
    if os.path.lexists(path / "meta.json"):
        return path  # a step-K directory (load opens meta.json only as a regular file)
    pointer = path / LATEST
    name = _latest_name(path)
    if name is None:
        raise CheckpointError(f"no checkpoint at {path}: neither meta.json nor a {LATEST!r} "
                              "file; give a checkpoint root or one of its step-K directories")
    directory = path / name
    if directory.is_symlink() or directory.resolve().parent != path.resolve():
        raise CheckpointError(f"{pointer} names {name}, which leads to {directory.resolve()}, "
                              f"not a directory inside {path}; `latest` must name one of the "
                              "root's own step-K directories: load the other checkpoint by its "
                              "own path")
    if not directory.is_dir() or not os.path.lexists(directory / "meta.json"):
        raise CheckpointError(f"{pointer} names {directory.name}, which has no meta.json; "
                              "the checkpoint is incomplete: load an older step-K directory")
    return directory


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


def _safe_reader(directory: Path, metadata):
    """DCP's reader, handed the metadata that `_read_dcp_metadata` already unpickled safely
    (DCP swallows errors raised inside `read_metadata`, so the check runs before it), opening
    shards only as regular files of `directory` itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RegularFilesOnly(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode != "rb" or Path(path).parent != directory:
                raise CheckpointError(f"refusing to open {path} ({mode}) while loading "
                                      f"{directory}")
            with _open_regular(Path(path), "a shard") as file:
                yield file

    class SafeFileSystemReader(dcp.FileSystemReader):
        def __init__(self, path):
            super().__init__(path)
            self.fs = RegularFilesOnly()

        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(directory)


def _read_dcp_metadata(path: Path, real: Path, meta: dict[str, Any]):
    """DCP's .metadata, checked against the sha256 meta.json records, unpickled under an
    allow-list of DCP's own metadata classes."""
    data = _read_regular(real, _MAX_BYTES[".metadata"], "DCP metadata",
                         "load an older step-K directory", shown=path)
    expected = meta.get("metadata_sha256")
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{path} does not match the sha256 that meta.json records for "
                              f"it; {DAMAGED}")
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle fails in many ways (EOFError, ...)
        raise CheckpointError(f"{path} is damaged ({type(err).__name__}: {err}); the checkpoint "
                              "is truncated or corrupt: load an older step-K directory or save "
                              "again") from None


def _check_dcp_metadata(path: Path, directory: Path, metadata, manifest: dict[str, Any],
                        rank_path: Path):
    """Refuse DCP metadata that samebits did not write (a non-tensor entry: DCP unpickles a
    bytes entry with `torch.load(weights_only=False)`, arbitrary code; a shard file outside
    the checkpoint directory; a storage transform; tensors that differ from the manifest;
    chunks that do not tile their tensor exactly, or lie outside their shard file) and return
    a clean copy holding this rank's tensors only, built from the checked values."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    foreign = "the file was not written by samebits.checkpoint: load an older step-K directory"
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} does not hold DCP checkpoint metadata; {foreign}")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{path}: entry {key!r} is declared as {type(entry).__name__}; samebits writes "
                "tensors only, and DCP would read such an entry with "
                f"torch.load(weights_only=False), which can run code. Refusing to load: {foreign}")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} has no shard index; {foreign}")
    storage: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", index)
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise CheckpointError(f"{path}: the shard index entry for {index} is not a "
                                  f"file location; {foreign}")
        if not _SHARD_FILE.fullmatch(info.relative_path):
            raise CheckpointError(f"{path}: {fqn!r} is stored in shard "
                                  f"file {info.relative_path!r}, not a __<rank>_<n>.distcp file "
                                  f"of this directory; refusing to read it: {foreign}")
        if info.transform_descriptors:
            raise CheckpointError(f"{path}: {fqn!r} is stored with "
                                  f"transforms {list(info.transform_descriptors)}, which samebits "
                                  f"never writes; {foreign}")
        offsets = getattr(index, "offset", None)
        if (not isinstance(index, MetadataIndex) or not isinstance(fqn, str)
                or not _is_dims(offsets) or not _is_count(info.offset) or not _is_count(info.length)):
            raise CheckpointError(f"{path}: the shard index entry for {fqn!r} is malformed "
                                  f"({index}: {info}); {foreign}")
        storage[(fqn, tuple(offsets))] = info

    clean_entries, clean_storage, sizes = {}, {}, {}
    spans: dict[str, list[tuple[int, int, str]]] = {}  # shard file -> (offset, end, tensor)
    for key, spec in manifest.items():
        entry = metadata.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(f"{rank_path} lists tensor {key!r}, which {path} does not "
                                  "hold; the checkpoint is incomplete: load an older step-K "
                                  "directory")
        dtype = getattr(entry.properties, "dtype", None)
        if (not isinstance(entry.properties, TensorProperties) or not isinstance(dtype, torch.dtype)
                or not _is_dims(entry.size) or not isinstance(entry.chunks, list)):
            raise CheckpointError(f"{path}: the entry of tensor {key!r} is malformed "
                                  f"(properties {entry.properties!r}, size {entry.size!r}); "
                                  f"{foreign}")
        shape = list(entry.size)
        if shape != spec["shape"] or dtype != getattr(torch, spec["dtype"]):
            raise CheckpointError(
                f"tensor {key!r}: {rank_path} says {spec['dtype']}{spec['shape']} but {path} "
                f"says {str(dtype).removeprefix('torch.')}{shape}; "
                "the checkpoint is damaged: load an older step-K directory")
        chunks = _check_tiling(path, key, shape, entry.chunks, ChunkStorageMetadata)
        clean_chunks = []
        for offsets, sizes_ in chunks:
            info = storage.get((key, offsets))
            if info is None:
                raise CheckpointError(f"{path}: tensor {key!r} has a chunk at {list(offsets)} "
                                      f"that the shard index does not locate; {DAMAGED}")
            if info.relative_path not in sizes:
                sizes[info.relative_path] = _regular_size(directory / info.relative_path, path)
            nbytes = math.prod(sizes_) * dtype.itemsize
            if info.offset + info.length > sizes[info.relative_path] or nbytes > info.length:
                raise CheckpointError(
                    f"{path}: tensor {key!r}'s chunk at {list(offsets)} ({nbytes} bytes) is "
                    f"stored at bytes {info.offset}..{info.offset + info.length} of "
                    f"{info.relative_path}, which has {sizes[info.relative_path]}: the shard is "
                    f"truncated or the index damaged; load an older step-K directory")
            spans.setdefault(info.relative_path, []).append(
                (info.offset, info.offset + info.length, key))
            clean_chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                     sizes=torch.Size(sizes_)))
            clean_storage[MetadataIndex(key, offsets)] = _StorageInfo(
                info.relative_path, info.offset, info.length)
        clean_entries[key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype), size=torch.Size(shape), chunks=clean_chunks)
    for (fqn, _), info in storage.items():  # a file this rank reads is whole, not only where it reads
        size = sizes.get(info.relative_path)
        if size is not None and info.offset + info.length > size:
            raise CheckpointError(
                f"{path}: {fqn!r} is stored at bytes {info.offset}..{info.offset + info.length} of "
                f"{info.relative_path}, which has {size}: the shard is truncated; load an older step-K "
                "directory")
    for name, file_spans in spans.items():  # so no byte is read into two tensors
        file_spans.sort()
        for (_, end, first), (start, _, second) in zip(file_spans, file_spans[1:]):
            if start < end:
                raise CheckpointError(f"{path}: tensors {first!r} and {second!r} are both stored "
                                      f"in bytes {start}..{end} of {name}; {DAMAGED}")
    version = metadata.version if isinstance(getattr(metadata, "version", None), str) else None
    return Metadata(state_dict_metadata=clean_entries, storage_data=clean_storage,
                    storage_meta=StorageMeta(), version=version)


def _check_tiling(path: Path, key: str, shape: list[int], chunks: list, chunk_type
                  ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The chunks of one tensor cover each of its elements exactly once: each lies inside the
    tensor, no two overlap and their sizes add up to its element count.  (DCP reads only what
    the chunks cover, and an uncovered element would keep whatever `torch.empty` left.)"""
    def refuse(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: the chunks of tensor {key!r} ({list(shape)}) {problem}, "
                               "so some of its elements would not be read (they would keep "
                               f"uninitialised memory); {DAMAGED}")

    if len(chunks) > _MAX_CHUNKS:
        raise refuse(f"number {len(chunks)}, more than the {_MAX_CHUNKS} samebits accepts")
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if (not isinstance(chunk, chunk_type) or not _is_dims(offsets) or not _is_dims(sizes)
                or len(offsets) != len(shape) or len(sizes) != len(shape)):
            raise refuse(f"include {chunk!r}, which is not a chunk of a {len(shape)}-D tensor")
        if any(o + n > dim for o, n, dim in zip(offsets, sizes, shape)):
            raise refuse(f"include one at {list(offsets)} of size {list(sizes)}, outside it")
        if math.prod(sizes) == 0 and math.prod(shape) > 0:
            raise refuse(f"include an empty one at {list(offsets)}")
        boxes.append((tuple(offsets), tuple(sizes)))
    total = sum(math.prod(sizes) for _, sizes in boxes)
    if total != math.prod(shape):
        raise refuse(f"hold {total} element(s) of its {math.prod(shape)}")
    boxes.sort()
    for i, (offsets, sizes) in enumerate(boxes):
        for other, other_sizes in boxes[i + 1:]:
            if shape and other[0] >= offsets[0] + sizes[0]:
                break  # sorted by the first offset: no later chunk reaches back into this one
            if all(a < b + m and b < a + n
                   for a, n, b, m in zip(offsets, sizes, other, other_sizes)):
                raise refuse(f"overlap (at {list(offsets)} and {list(other)})")
    return boxes


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_dims(value: Any) -> bool:
    """A torch.Size (or tuple) of at most 64 non-negative ints: a shape or chunk offsets."""
    return (isinstance(value, (torch.Size, tuple)) and len(value) <= _MAX_DIMS
            and all(_is_count(n) for n in value))


def _tensor_only_planner():
    """DCP's default load planner, except that it refuses to unpickle bytes entries
    (a second line of defence behind `_check_dcp_metadata`)."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class TensorOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is stored as "
                                  "bytes; samebits never unpickles bytes entries (that could run "
                                  "code): load a checkpoint written by samebits.checkpoint")

    return TensorOnlyLoadPlanner()


class _MetadataUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("torch", "Size"), ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    }

    def find_class(self, module: str, name: str):
        obj = None
        if (module, name) in self._ALLOWED:
            obj = super().find_class(module, name)
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            obj = getattr(torch, name)
        elif module == "torch.distributed.checkpoint.metadata" and name.isidentifier():
            # a class defined in that module (not one it imports, e.g. enum.Enum, nor a
            # dotted path walked from one): its dataclasses and enums
            candidate = super().find_class(module, name)
            if (isinstance(candidate, type) and candidate.__module__ == module
                    and (dataclasses.is_dataclass(candidate) or issubclass(candidate, enum.Enum))):
                obj = candidate
        if obj is None:
            raise CheckpointError(f"DCP metadata refers to {module}.{name}, which is not a DCP "
                                  "metadata type; refusing to unpickle it")
        return obj


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


def _open_regular(path: Path, what: str, shown: Path | None = None):
    """`path` opened for reading if it is a regular file, never through a symlink (which
    could lead out of the checkpoint) and never blocking (a FIFO would hang the load)."""
    flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    shown = shown or path
    try:
        if os.path.islink(path):  # O_NOFOLLOW refuses it too; this names the problem
            raise CheckpointError(f"{shown} is a symbolic link (to {os.readlink(path)}); {what} "
                                  "is read only as a regular file inside the checkpoint "
                                  "directory: replace the link by the file, or load an older "
                                  "step-K directory")
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{shown} is missing: the checkpoint is incomplete or was written "
                              "by another world size; load an older step-K directory") from None
    except OSError as err:
        raise CheckpointError(f"{shown} cannot be opened as {what} ({err}); load an older "
                              "step-K directory") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{shown} is not a regular file ({_file_kind(mode)}); {what} is "
                              "read only from a regular file inside the checkpoint directory: "
                              "load an older step-K directory")
    if flags & getattr(os, "O_NONBLOCK", 0):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _read_regular(path: Path, limit: int, what: str, remedy: str, shown: Path | None = None) -> bytes:
    """The bytes of a regular file (`_open_regular`) of at most `limit` bytes."""
    shown = shown or path
    with _open_regular(path, what, shown) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{shown} holds more than {limit} bytes, more than {what} can be: "
                              f"it is damaged or not a samebits file; {remedy}")
    return data


def _regular_size(path: Path, shown_from: Path) -> int:
    """Size of a shard file, refused unless it is a regular file (not a link) of the directory."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{shown_from} locates tensors in {path.name}, which is missing: the "
                              "checkpoint is incomplete; load an older step-K directory") from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}); a shard is "
                              "read only as a regular file inside the checkpoint directory: "
                              "replace the link by the file, or load an older step-K directory")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file ({_file_kind(info.st_mode)}); a shard "
                              "is read only from a regular file inside the checkpoint directory: "
                              "load an older step-K directory")
    return info.st_size


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
