"""Rank walks in parallel processes, merged into exactly the result of the serial walk: ranks whose
walk the chunk's own bound could have changed are walked again with the serial bound
(docs/scale.md; tests/test_scale.py).  Processes, not threads: the per-frame work holds the GIL.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import torch.distributed as dist

from samebits.compare._walk import _Bound, _Walk
from samebits.errors import ConfigError, SamebitsError
from samebits.stream.reader import Run, StreamReader

# Below this many stream bytes (both runs), `jobs=None` stays serial: starting processes
# costs more than it saves on a small run.
AUTO_PARALLEL_MIN_BYTES = 64 << 20
CHUNKS_PER_JOB = 4  # more chunks than workers: a slow chunk does not hold up the others


@dataclass
class RankWalk:
    """One rank's walk: the `_Walk` (its counts, notes, incomplete reasons), its first
    divergence (or None), whether the twin path (byte-equal streams, bound-independent)
    decided it, and the error it raised, if any."""

    rank: int
    walk: Any
    divergence: Any
    twin: bool = False
    error: SamebitsError | None = None


def num_jobs(jobs: int | None, run_a: Run, run_b: Run, ranks: list[int]) -> int:
    """How many processes to use: ``jobs`` when given (1 is serial), else one per core
    available to this process when the runs are large enough to gain from it."""
    if jobs is not None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ConfigError(f"jobs (--jobs) = {jobs!r}: give a positive number of processes (1 is serial).")
        return min(jobs, max(1, len(ranks)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if cores < 2 or len(ranks) < 2:
        return 1
    total = 0
    for run in (run_a, run_b):
        for rank in ranks:
            total += run.files[rank].stat().st_size
            if total >= AUTO_PARALLEL_MIN_BYTES:
                return min(cores, len(ranks))
    return 1


def walk_ranks(run_a: Run, run_b: Run, ranks: list[int], start: int, stop: int | None, verify: bool,
               jobs: int) -> Iterator[RankWalk]:
    """Yield every rank's walk in rank order, equal to the serial walk's (module docstring)."""
    paths = _paths(run_a, run_b, ranks)
    num_chunks = min(len(paths), jobs * CHUNKS_PER_JOB)
    chunks = _slices(paths, num_chunks)
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_walk_chunk, chunk, start, stop, verify) for chunk in chunks]
        try:
            walked = ((where, result) for chunk, future in zip(chunks, futures)
                      for where, result in zip(chunk, future.result()))
            yield from _merge(walked, start, stop, verify)
        finally:
            for future in futures:
                future.cancel()


def distributed_walks(run_a: Run, run_b: Run, ranks: list[int], start: int, stop: int | None, verify: bool,
                      group=None) -> Iterator[RankWalk]:
    """`walk_ranks` as a distributed job: process p of the ``group`` (default: the world of
    `torch.distributed`, as started by torchrun) walks the p-th contiguous slice of ranks,
    the walks are all-gathered (gloo, NCCL: the user's backend) and every process merges
    them into the serial result."""
    paths = _paths(run_a, run_b, ranks)
    with _process_group():
        size, me = dist.get_world_size(group), dist.get_rank(group)
        mine = _slices(paths, size)[me] if me < len(paths) else []
        gathered: list[Any] = [None] * size
        dist.all_gather_object(gathered, _walk_chunk(mine, start, stop, verify), group=group)
    by_rank = {result.rank: result for results in gathered for result in results}
    walked = ((where, by_rank[where[0]]) for where in paths)
    yield from _merge(walked, start, stop, verify)


@contextlib.contextmanager
def _process_group():
    """The caller's process group, or one started here from torchrun's environment (gloo:
    the gathered walks are a few bytes per rank) and ended afterwards."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    if not dist.is_available() or not all(os.environ.get(v) for v in ("MASTER_ADDR", "RANK", "WORLD_SIZE")):
        raise ConfigError("a distributed comparison runs under torchrun (or with torch.distributed initialised): "
                          "torchrun --nproc-per-node N -m samebits diff --distributed RUN_A RUN_B")
    global started_process_group
    dist.init_process_group("gloo")
    started_process_group = True
    try:
        yield
    finally:
        dist.destroy_process_group()


# Set once this process has started (and ended) a gloo group of its own: `python -m samebits`
# then ends with os._exit, since gloo's C++ static destructors abort now and then at exit.
started_process_group = False


def _paths(run_a: Run, run_b: Run, ranks: list[int]) -> list[tuple[int, str, str]]:
    return [(rank, str(run_a.files[rank]), str(run_b.files[rank])) for rank in ranks]


def _slices(items: list, num: int) -> list[list]:
    """``items`` in ``num`` contiguous slices of (almost) equal length, in order."""
    num = max(1, min(num, len(items)))
    size, extra = divmod(len(items), num)
    slices, at = [], 0
    for index in range(num):
        end = at + size + (1 if index < extra else 0)
        slices.append(items[at:end])
        at = end
    return slices


def _merge(walked, start, stop, verify) -> Iterator[RankWalk]:
    """Replay the serial loop over ((rank, path_a, path_b), walk) in rank order: keep each
    walk its bound did not affect, walk the others again with the serial bound."""
    bound = _Bound()
    for (rank, path_a, path_b), result in walked:
        serial = bound.step
        settled = result.twin or serial is None or (
            result.divergence is not None and result.divergence.step <= serial)
        if not settled:  # the walk's bound was not the serial one: walk it as serial does
            result = _walk_one(rank, path_a, path_b, start, stop, verify, bound)
        if result.error is not None:
            raise result.error
        if result.divergence is not None:
            bound.lower(result.divergence.step)
        yield result


def _walk_chunk(chunk, start, stop, verify) -> list[RankWalk]:
    """A worker: walk a chunk of ranks in order, with a bound shared by the chunk only."""
    bound = _Bound()
    results = []
    for rank, path_a, path_b in chunk:
        result = _walk_one(rank, path_a, path_b, start, stop, verify, bound, keep_errors=True)
        result.walk.shared_bound = None  # the bound stays here; the walk's counts travel
        results.append(result)
    return results


def _walk_one(rank, path_a, path_b, start, stop, verify, bound, keep_errors=False) -> RankWalk:
    walk = _Walk(start, stop, verify, bound)
    try:
        found = walk.rank(rank, StreamReader(path_a), StreamReader(path_b))
    except SamebitsError as err:
        if not keep_errors:
            raise
        return RankWalk(rank, walk, None, twin=walk.twin, error=err)
    return RankWalk(rank, walk, None if found is None else found[1], twin=walk.twin)


__all__ = ["RankWalk", "num_jobs", "walk_ranks", "distributed_walks", "AUTO_PARALLEL_MIN_BYTES"]
