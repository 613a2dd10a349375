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
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import os
import pickle
import re
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
from samebits.fingerprint import digest_many
from samebits.checkpoint._bundle import StateBundle, apply, collect, empty_tensors
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError

FORMAT = "samebits-checkpoint/1"
LATEST = "latest"

# Directories of a commit in progress (see `_commit`); only `latest` can make one of them live.
_STAGED, _ASIDE, _LINKED = ".staged-", ".old-", ".link-"
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's FileSystemWriter names: __<rank>_<n>.distcp
_RANK_FIELDS = ("progress", "metadata", "optimizer", "lr_scheduler", "rng", "tensors")

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
    rank, world_size = group_rank_and_world_size()
    root = Path(path)
    step = int(bundle.progress["step"])
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _finish_or_remove_interrupted_commits(root)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir()
    _barrier(world_size)

    tensors, plain = collect(bundle, rank)
    if world_size > 1:
        _check_shared_tensors(tensors, rank)
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
        _commit(root, tmp, final)
    _barrier(world_size)
    return final


def _check_shared_tensors(tensors: dict[str, torch.Tensor], rank: int) -> None:
    """Refuse, on every rank, to save a tensor that is not rank-local but differs between ranks.

    DCP stores one copy of such a tensor (rank 0's), so a resume would give every rank rank 0's
    value and the run would change at the resume: replicas that drifted apart (a missing
    gradient all-reduce did exactly that once) must be found here, not after the resume.  A
    tensor held by one rank only (a pipeline stage's), DTensors (DCP saves their shards) and
    other tensor subclasses (their layout is theirs to save) are not compared.  One digest per tensor and one small all-gather."""
    from torch.distributed.tensor import DTensor

    shared = {key: t for key, t in tensors.items()
              if "@rank" not in key and isinstance(t, torch.Tensor) and not isinstance(t, DTensor)
              and (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)}  # tensor subclasses: DCP's own
    mine = dict(zip(shared, digest_many(shared.values())))
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    differing = []
    for key in sorted(set().union(*gathered)):
        holders = {r: digests[key] for r, digests in enumerate(gathered) if key in digests}
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
    plain name of an entry inside ROOT."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{pointer} cannot be read ({err}); write the name of a "
                              "step-K directory into it, or load a step-K directory") from None
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or "\n" in name or Path(name).name != name):
        raise CheckpointError(f"{pointer} holds {name!r}, which is not the name of a directory "
                              f"inside {root}; a checkpoint's `latest` names one of its own "
                              "step-K directories: fix the file or load a step-K directory")
    return name


def load(path: str | os.PathLike, bundle: StateBundle) -> Path:
    """Load into the bundle in place; `path` is a root (follows `latest`) or a step-K dir.

    Collective, like `save`.  Refuses (CheckpointLayoutError) a checkpoint written by another
    world size or layout.  Returns the directory it loaded.
    """
    rank, world_size = group_rank_and_world_size()
    directory = resolve(path)
    meta = _read_meta(directory / "meta.json")
    if meta["world_size"] != world_size or meta["layout"] != dict(bundle.layout):
        raise CheckpointLayoutError(
            f"{directory} was saved with world_size={meta['world_size']} and layout "
            f"{meta['layout']}, but rank {rank} loads it with world_size={world_size} and "
            f"layout {dict(bundle.layout)}; resume with the saved world size and layout "
            "(per-rank random states and shards cannot be moved bitwise)")
    rank_path = directory / f"rank-{rank}.json"
    plain = _read_rank_manifest(rank_path, rank)
    tensors = empty_tensors(plain)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    metadata = _read_dcp_metadata(directory)
    _check_dcp_metadata(directory / ".metadata", metadata, plain["tensors"], rank_path)
    reader = _safe_reader(directory, metadata)
    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=reader, planner=_tensor_only_planner(),
                     no_dist=world_size == 1)
    except CheckpointException as err:
        raise CheckpointError(f"{directory}: rank {rank} could not read its tensors ({err}); "
                              "the shards are damaged or incomplete: load an older step") from err
    skip = [name.strip() for name in os.environ.get(DROP_RNG_ENV, "").split(",") if name.strip()]
    if skip:
        print(f"samebits.checkpoint: rank {rank} leaves out random state(s) {', '.join(skip)} "
              f"on purpose ({DROP_RNG_ENV}); the resume will not be bitwise",
              file=sys.stderr, flush=True)
    try:
        apply(bundle, tensors, plain, skip_rng=skip)
    except (KeyError, IndexError, TypeError, AttributeError) as err:
        # valid JSON, but not the tree `save` wrote (hand-edited or from another version)
        raise CheckpointError(f"{rank_path} does not hold the values samebits writes "
                              f"({type(err).__name__}: {err}); the file is damaged: load an "
                              "older step-K directory or save again") from None
    return directory


def resolve(path: str | os.PathLike) -> Path:
    """The committed checkpoint directory `path` names (a step-K dir, or a root's latest)."""
    path = Path(path)
    if (path / "meta.json").is_file():
        return path
    pointer = path / LATEST
    name = _latest_name(path)
    if name is None:
        raise CheckpointError(f"no checkpoint at {path}: neither meta.json nor a {LATEST!r} "
                              "file; give a checkpoint root or one of its step-K directories")
    directory = path / name
    if directory.resolve().parent != path.resolve():  # e.g. step-K, a symlink to elsewhere
        raise CheckpointError(f"{pointer} names {name}, which leads to {directory.resolve()}, "
                              f"not a directory inside {path}; `latest` must name one of the "
                              "root's own step-K directories: load the other checkpoint by its "
                              "own path")
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
    path = directory / ".metadata"
    try:
        with open(path, "rb") as file:
            return _MetadataUnpickler(file).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; load an "
                              "older step-K directory") from None
    except CheckpointError:
        raise
    except Exception as err:  # a truncated or garbled pickle fails in many ways (EOFError, ...)
        raise CheckpointError(f"{path} is damaged ({type(err).__name__}: {err}); the checkpoint "
                              "is truncated or corrupt: load an older step-K directory or save "
                              "again") from None


def _check_dcp_metadata(path: Path, metadata, manifest: dict[str, Any], rank_path: Path) -> None:
    """Refuse DCP metadata that samebits did not write: a non-tensor entry (DCP unpickles a
    bytes entry with `torch.load(weights_only=False)`: arbitrary code), a shard file outside
    the checkpoint directory, a storage transform, or tensors that differ from the manifest."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

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
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise CheckpointError(f"{path}: the shard index entry for {index} is not a "
                                  f"file location; {foreign}")
        if not _SHARD_FILE.fullmatch(info.relative_path):
            raise CheckpointError(f"{path}: {getattr(index, 'fqn', index)!r} is stored in shard "
                                  f"file {info.relative_path!r}, not a __<rank>_<n>.distcp file "
                                  f"of this directory; refusing to read it: {foreign}")
        if info.transform_descriptors:
            raise CheckpointError(f"{path}: {getattr(index, 'fqn', index)!r} is stored with "
                                  f"transforms {list(info.transform_descriptors)}, which samebits "
                                  f"never writes; {foreign}")
    for key, spec in manifest.items():
        entry = metadata.state_dict_metadata.get(key)
        if entry is None:
            raise CheckpointError(f"{rank_path} lists tensor {key!r}, which {path} does not "
                                  "hold; the checkpoint is incomplete: load an older step-K "
                                  "directory")
        if list(entry.size) != spec["shape"] or entry.properties.dtype != getattr(torch, spec["dtype"]):
            raise CheckpointError(
                f"tensor {key!r}: {rank_path} says {spec['dtype']}{spec['shape']} but {path} "
                f"says {str(entry.properties.dtype).removeprefix('torch.')}{list(entry.size)}; "
                "the checkpoint is damaged: load an older step-K directory")


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
    with open(path, "w") as file:
        json.dump(value, file, indent=1)
        file.flush()
        os.fsync(file.fileno())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as file:
            value = json.load(file)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or was written "
                              "by another world size") from None
    except (ValueError, OSError) as err:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path} is damaged ({err}); the checkpoint is truncated or "
                              "corrupt: load an older step-K directory or save again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is damaged: it holds a JSON {type(value).__name__}, not "
                              "an object; load an older step-K directory or save again")
    return value


def _read_meta(path: Path) -> dict[str, Any]:
    """meta.json, with the fields `load` relies on checked."""
    meta = _read_json(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}; "
                              "this is not a samebits checkpoint of this version")
    expected = {"world_size": int, "layout": dict, "step": int}
    for field_name, kind in expected.items():
        if field_name not in meta:
            raise CheckpointError(f"{path} has no {field_name!r}: it is damaged or was edited; "
                                  "load an older step-K directory or save again")
        if not isinstance(meta[field_name], kind) or isinstance(meta[field_name], bool):
            raise CheckpointError(f"{path}: {field_name!r} is {meta[field_name]!r}, not a "
                                  f"{kind.__name__}; the file is damaged: load an older step-K "
                                  "directory or save again")
    return meta


def _read_rank_manifest(path: Path, rank: int) -> dict[str, Any]:
    """rank-<r>.json, with its fields and tensor manifest checked."""
    plain = _read_json(path)
    missing = [name for name in _RANK_FIELDS if name not in plain]
    if missing or plain.get("rank") != rank:
        what = f"fields {missing}" if missing else f"rank {rank} (it says {plain.get('rank')!r})"
        raise CheckpointError(f"{path} lacks {what}: the file is damaged or was edited; load an "
                              "older step-K directory or save again")
    tensors = plain["tensors"]
    bad = [key for key, spec in tensors.items() if not _is_tensor_spec(spec)] \
        if isinstance(tensors, dict) else ["(the manifest is not a JSON object)"]
    if bad:
        raise CheckpointError(f"{path} lists tensors without a valid shape and dtype: "
                              f"{bad[:5]}; the file is damaged: load an older step-K directory")
    return plain


def _is_tensor_spec(spec: Any) -> bool:
    return (isinstance(spec, dict) and isinstance(spec.get("shape"), list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                    for n in spec["shape"])
            and isinstance(spec.get("dtype"), str)
            and isinstance(getattr(torch, spec["dtype"], None), torch.dtype))


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
