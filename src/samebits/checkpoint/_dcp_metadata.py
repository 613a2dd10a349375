"""The checks of DCP's `.metadata` (`_check_dcp_metadata` lists them), and a reader and
planner that enforce them while the shards are read."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import io
import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from samebits.checkpoint._bundle import DAMAGED
from samebits.checkpoint._errors import CheckpointError
from samebits.checkpoint._manifests import _MAX_BYTES, _is_count, _is_dims
from samebits.checkpoint._regular import _open_regular, _read_regular, _regular_size

_MAX_CHUNKS = 1024  # per tensor; samebits writes one (DCP one per shard of a DTensor)
_SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")  # DCP's FileSystemWriter names: __<rank>_<n>.distcp


def _safe_reader(directory: Path, metadata):
    """DCP's reader with the metadata `_read_dcp_metadata` unpickled safely (DCP swallows errors
    inside `read_metadata`), opening shards only as regular files of `directory` itself."""
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
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    storage = _shard_index(path, metadata)
    clean_entries, clean_storage, sizes = {}, {}, {}
    spans: dict[str, list[tuple[int, int, str]]] = {}  # shard file -> (offset, end, tensor)
    for key, spec in manifest.items():
        clean_entries[key] = _clean_entry(path, directory, metadata, storage, key, spec, rank_path, sizes, spans,
                                          clean_storage)
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


_FOREIGN = "the file was not written by samebits.checkpoint: load an older step-K directory"


def _shard_index(path: Path, metadata) -> dict[tuple[str, tuple[int, ...]], Any]:
    """(tensor, chunk offsets) -> where DCP's metadata stores it, every entry of the metadata
    checked to be a tensor (never bytes) stored in a shard file of the directory, untransformed."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{path} does not hold DCP checkpoint metadata; {_FOREIGN}")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(
                f"{path}: entry {key!r} is declared as {type(entry).__name__}; samebits writes "
                "tensors only, and DCP would read such an entry with "
                f"torch.load(weights_only=False), which can run code. Refusing to load: {_FOREIGN}")
    if not isinstance(metadata.storage_data, dict):
        raise CheckpointError(f"{path} has no shard index; {_FOREIGN}")
    storage: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in metadata.storage_data.items():
        fqn = getattr(index, "fqn", index)
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str):
            raise CheckpointError(f"{path}: the shard index entry for {index} is not a "
                                  f"file location; {_FOREIGN}")
        if not _SHARD_FILE.fullmatch(info.relative_path):
            raise CheckpointError(f"{path}: {fqn!r} is stored in shard "
                                  f"file {info.relative_path!r}, not a __<rank>_<n>.distcp file "
                                  f"of this directory; refusing to read it: {_FOREIGN}")
        if info.transform_descriptors:
            raise CheckpointError(f"{path}: {fqn!r} is stored with "
                                  f"transforms {list(info.transform_descriptors)}, which samebits "
                                  f"never writes; {_FOREIGN}")
        offsets = getattr(index, "offset", None)
        if (not isinstance(index, MetadataIndex) or not isinstance(fqn, str)
                or not _is_dims(offsets) or not _is_count(info.offset) or not _is_count(info.length)):
            raise CheckpointError(f"{path}: the shard index entry for {fqn!r} is malformed "
                                  f"({index}: {info}); {_FOREIGN}")
        storage[(fqn, tuple(offsets))] = info
    return storage


def _clean_entry(path: Path, directory: Path, metadata, storage: dict, key: str, spec: dict[str, Any],
                 rank_path: Path, sizes: dict[str, int], spans: dict[str, list], clean_storage: dict):
    """The checked metadata of the manifest's tensor ``key``: its entry matches the manifest,
    its chunks tile it and each lies inside its shard file (whose size goes to ``sizes``, the
    bytes it spans to ``spans``, its location to ``clean_storage``)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                       TensorStorageMetadata)

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
                              f"{_FOREIGN}")
    shape = list(entry.size)
    if shape != spec["shape"] or dtype != getattr(torch, spec["dtype"]):
        raise CheckpointError(
            f"tensor {key!r}: {rank_path} says {spec['dtype']}{spec['shape']} but {path} "
            f"says {str(dtype).removeprefix('torch.')}{shape}; "
            "the checkpoint is damaged: load an older step-K directory")
    clean_chunks = []
    for offsets, sizes_ in _check_tiling(path, key, shape, entry.chunks, ChunkStorageMetadata):
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
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, key))
        clean_chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes_)))
        clean_storage[MetadataIndex(key, offsets)] = _StorageInfo(info.relative_path, info.offset, info.length)
    return TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                                 chunks=clean_chunks)


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
