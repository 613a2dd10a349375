"""A checkpoint's training state, hashed so that the same state saved at any layout hashes alike.

The files of a checkpoint depend on the world size (one shard file and manifest per rank,
each rank's piece of a sharded tensor), so two layouts that hold the same training state
write different bytes.  `content_sha256` reads every saved model and optimizer tensor,
joins each one's pieces into its global value by their recorded places (`_layout`'s
pieces: replicas counted once, a TP shard at its offsets), and hashes, in sorted order of
name, each tensor's (name, dtype, global shape, bytes), then the global progress (step,
consumed samples).  No process group is needed: one process reads every rank's part.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from samebits.checkpoint._bundle import empty_tensors
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError
from samebits.checkpoint._layout import _cut, _pieces, _same_on_every_rank
from samebits.checkpoint._storage import (FORMAT, _check_dcp_metadata, _check_digests, _quiet_single_process,
                                          _read_dcp_metadata, _read_meta, _read_rank_manifest, _safe_reader,
                                          _tensor_only_planner, resolve)

PROGRESS_FIELDS = ("step", "consumed_samples")  # the global progress the hash covers


def content_sha256(path: str | os.PathLike) -> dict[str, Any]:
    """The SHA-256 of the training state the checkpoint ``path`` (a root's latest or a step-K
    directory) holds, independent of the layout it was saved at.

    Covered: every model and optimizer tensor as its global value (the saved pieces joined
    by their places, `StateBundle.shards`; a replicated tensor once), by sorted name, as
    (name, dtype, global shape, bytes); and the progress fields ``step`` and
    ``consumed_samples``.  Left out: random states (per rank by nature: each rank's streams,
    or the live states of a program that reseeds every draw), optimizer settings, the LR
    schedule and metadata (plain values, not the trained state).

    Returns {"sha256", "step", "tensors" (how many), "elements", "world_size"}.  A piece that
    does not tile its tensor, replicas that drifted apart, a rank-local tensor without a place
    that differs per rank, or progress that differs per rank has no global value: a
    `CheckpointLayoutError` naming it; a damaged checkpoint a `CheckpointError`.
    """
    directory = resolve(path)
    real = Path(os.path.realpath(directory))
    meta = _read_meta(directory / "meta.json", real / "meta.json")
    saved = [_read_rank_manifest(directory / f"rank-{r}.json", real / f"rank-{r}.json", r, meta)
             for r in range(meta["world_size"])]
    source = str(directory)
    _same_on_every_rank(saved, "progress", source)
    pieces = _pieces(saved, source)  # base key -> its distinct pieces (refuses drifted replicas)
    reads = {piece.key: piece.spec for found in pieces.values() for piece in found}
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
    if meta["format"] == FORMAT:
        _check_digests(tensors, reads, meta, directory / "meta.json", directory)

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
        total.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elements += value.numel()
    progress = saved[0]["progress"]
    covered = {name: progress.get(name) for name in PROGRESS_FIELDS}
    total.update(json.dumps(covered, sort_keys=True).encode())
    return {"sha256": total.hexdigest(), "step": meta["step"], "tensors": len(pieces), "elements": elements,
            "world_size": meta["world_size"]}


__all__ = ["content_sha256", "PROGRESS_FIELDS"]
