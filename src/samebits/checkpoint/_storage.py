"""On-disk checkpoints: DCP shards written into a temporary directory, committed by rename.

Layout of a checkpoint root:

    ROOT/latest                 "step-K": the last committed checkpoint (replaced atomically)
    ROOT/step-K/.metadata       DCP metadata (written by rank 0)
    ROOT/step-K/__<r>_0.distcp  DCP shards (each rank writes its own)
    ROOT/step-K/rank-<r>.json   rank r's plain values and tensor manifest
    ROOT/step-K/meta.json       format, world size, layout, step (written last, by rank 0)

A save writes into ROOT/.tmp-step-K, fsyncs every file, then rank 0 renames the directory
to ROOT/step-K and replaces `latest`.  A process killed before the rename leaves only a
.tmp directory that nothing reads (the next save of that step removes it), so the previous
checkpoint stays the loadable one.

Loading never unpickles arbitrary objects: tensors go through DCP's `weights_only` reader,
DCP's metadata through an unpickler that only accepts DCP's own metadata classes, and
everything else is JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import pickle
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from samebits.checkpoint._bundle import StateBundle, apply, collect, empty_tensors
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError

FORMAT = "samebits-checkpoint/1"
LATEST = "latest"

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
    rank, world_size = _rank_and_world_size()
    root = Path(path)
    step = int(bundle.progress["step"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir()
    _barrier(world_size)

    tensors, plain = collect(bundle, rank)
    import torch.distributed.checkpoint as dcp  # here: importing it takes ~0.6 s

    with _quiet_single_process():
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 no_dist=world_size == 1)
    pause = float(os.environ.get(SAVE_PAUSE_ENV, "0") or 0)
    if pause > 0:
        print(f"samebits.checkpoint: rank {rank} wrote its shards to {tmp}; pausing {pause} s "
              f"before the commit ({SAVE_PAUSE_ENV})", file=sys.stderr, flush=True)
        time.sleep(pause)
    _write_json(tmp / f"rank-{rank}.json", {"rank": rank, **plain})
    _barrier(world_size)

    if rank == 0:
        _write_json(tmp / "meta.json", {
            "format": FORMAT, "world_size": world_size, "layout": dict(bundle.layout),
            "step": step, "torch_version": torch.__version__,
        })
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step: move the old one aside, then drop it
            aside = root / f".old-step-{step}-{os.getpid()}"
            os.rename(final, aside)
            os.rename(tmp, final)
            shutil.rmtree(aside)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
        latest_tmp = root / f".{LATEST}.tmp"
        latest_tmp.write_text(f"{final.name}\n")
        _fsync_file(latest_tmp)
        os.replace(latest_tmp, root / LATEST)
        _fsync_dir(root)
    _barrier(world_size)
    return final


def load(path: str | os.PathLike, bundle: StateBundle) -> Path:
    """Load into the bundle in place; `path` is a root (follows `latest`) or a step-K dir.

    Collective, like `save`.  Refuses (CheckpointLayoutError) a checkpoint written by another
    world size or layout.  Returns the directory it loaded.
    """
    rank, world_size = _rank_and_world_size()
    directory = resolve(path)
    meta = _read_json(directory / "meta.json")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["world_size"] != world_size or meta["layout"] != dict(bundle.layout):
        raise CheckpointLayoutError(
            f"{directory} was saved with world_size={meta['world_size']} and layout "
            f"{meta['layout']}, but rank {rank} loads it with world_size={world_size} and "
            f"layout {dict(bundle.layout)}; resume with the saved world size and layout "
            "(per-rank random states and shards cannot be moved bitwise)")
    plain = _read_json(directory / f"rank-{rank}.json")
    tensors = empty_tensors(plain)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = _safe_reader(directory, _read_dcp_metadata(directory))
    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=reader, no_dist=world_size == 1)
    except CheckpointException as err:
        raise CheckpointError(f"{directory}: rank {rank} could not read its tensors ({err}); "
                              "the shards are damaged or incomplete: load an older step") from err
    skip = [name.strip() for name in os.environ.get(DROP_RNG_ENV, "").split(",") if name.strip()]
    if skip:
        print(f"samebits.checkpoint: rank {rank} leaves out random state(s) {', '.join(skip)} "
              f"on purpose ({DROP_RNG_ENV}); the resume will not be bitwise",
              file=sys.stderr, flush=True)
    apply(bundle, tensors, plain, skip_rng=skip)
    return directory


def resolve(path: str | os.PathLike) -> Path:
    """The committed checkpoint directory `path` names (a step-K dir, or a root's latest)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        raise CheckpointError(f"no checkpoint at {path}: neither meta.json nor a {LATEST!r} "
                              "file; give a checkpoint root or one of its step-K directories")
    directory = path / pointer.read_text().strip()
    if not (directory / "meta.json").is_file():
        raise CheckpointError(f"{pointer} names {directory.name}, which has no meta.json; "
                              "the checkpoint is incomplete: load an older step-K directory")
    return directory


def _safe_reader(directory: Path, metadata):
    """DCP's reader, handed the metadata that `_read_dcp_metadata` already unpickled safely
    (DCP swallows errors raised inside `read_metadata`, so the check runs before it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(directory)


def _read_dcp_metadata(directory: Path):
    """DCP's .metadata, unpickled under an allow-list of DCP's own metadata classes."""
    try:
        with open(directory / ".metadata", "rb") as file:
            return _MetadataUnpickler(file).load()
    except FileNotFoundError:
        raise CheckpointError(f"{directory}/.metadata is missing: the checkpoint is "
                              "incomplete") from None


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
        elif module == "torch.distributed.checkpoint.metadata":
            candidate = super().find_class(module, name)
            if isinstance(candidate, type) and (dataclasses.is_dataclass(candidate)
                                                or issubclass(candidate, enum.Enum)):
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


def _rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _write_json(path: Path, value: Any) -> None:
    with open(path, "w") as file:
        json.dump(value, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def _read_json(path: Path) -> Any:
    try:
        with open(path) as file:
            return json.load(file)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or was written "
                              "by another world size") from None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
