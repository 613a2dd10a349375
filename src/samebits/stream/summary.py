"""What a recorded run holds: per-rank counts and status, and the catalogue of its records."""

from __future__ import annotations

import os
from dataclasses import dataclass

from samebits.errors import ConfigError
from samebits.stream.reader import open_run
from samebits.verdicts import ToDict


def summarise(path: str | os.PathLike) -> dict:
    """Per-rank counts and status, the config and environment; every frame is verified (a
    damaged stream raises `StreamError`)."""
    run_dir = open_run(path)
    ranks = []
    for rank in run_dir.ranks:
        reader = run_dir.stream(rank)
        num_steps = num_records = 0
        first = last = None
        try:
            for block in reader.steps():
                num_steps += 1
                num_records += block.num_records
                first = block.step if first is None else first
                last = block.step
        finally:
            reader.close()
        ranks.append({
            "rank": rank, "steps": num_steps, "first_step": first, "last_step": last,
            "records": num_records, "bytes": reader.size, "segments": reader.num_segments,
            "status": "closed" if reader.closed_cleanly else (reader.stop_reason or "open"),
            "coords": reader.header.coords,
        })
    header = run_dir.header
    return {"run": str(path), "run_id": header.run_id, "world_size": run_dir.world_size,
            "ranks": ranks, "config": header.config, "environment": header.environment,
            "determinism": header.determinism, "window": header.window,
            "selection": {"phases": header.phases, "ranks": header.ranks, "include": header.include,
                          "exclude": header.exclude, "max_tensor_bytes": header.max_tensor_bytes}}


@dataclass(frozen=True)
class CatalogueEntry(ToDict):
    """One recorded name of one step: what it is and how often it occurs in the step."""

    phase: str
    name: str
    kind: str  # "tensor" | "metric"
    dtype: str
    shape: tuple[int, ...] | None
    count: int  # occurrences in the step
    digested: bool  # False: recorded as absent, or over the size cap (shape and dtype only)


def catalogue(path: str | os.PathLike, *, rank: int | None = None, step: int | None = None) -> tuple[int, int, list[CatalogueEntry]]:
    """What one step of one rank recorded, in record order: (rank, step, entries).  Defaults:
    the lowest rank, its first step."""
    run_dir = open_run(path)
    ranks = run_dir.ranks
    rank = ranks[0] if rank is None else rank
    if rank not in ranks:
        raise ConfigError(f"{path}: rank {rank} has no stream (recorded ranks: {_short(ranks)}).")
    reader = run_dir.stream(rank)
    try:
        seen = []
        for block in reader.steps():
            seen.append(block.step)
            if step is None or block.step == step:
                entries: dict[tuple, CatalogueEntry] = {}
                for record in block.records():
                    key = (record.phase, record.name, record.kind)
                    old = entries.get(key)
                    digested = record.kind == "metric" or (record.digest is not None and not record.absent)
                    entries[key] = CatalogueEntry(record.phase, record.name, record.kind, record.dtype, record.shape,
                                                  1 if old is None else old.count + 1,
                                                  digested if old is None else old.digested and digested)
                return rank, block.step, list(entries.values())
    finally:
        reader.close()
    if not seen:
        raise ConfigError(f"{path}: rank {rank} recorded no step.")
    raise ConfigError(f"{path}: rank {rank} has no step {step} (recorded: {_short(seen)}).")


def _short(values: list[int]) -> str:
    return ", ".join(map(str, values[:10])) + (f", ... ({len(values)} in all)" if len(values) > 10 else "")


__all__ = ["summarise", "catalogue", "CatalogueEntry"]
