"""Cost of global (layout-independent) digests against local ones, on 2 gloo ranks.

    python benchmarks/bench_global_digest.py [--steps 40] [--json]

A tiny tensor-parallel model (two Linear layers, ColwiseParallel then RowwiseParallel, as in
tests/test_global_digest.py but wider) on 2 CPU ranks over gloo.  Per "step", timed on
rank 0 after a barrier, the median over ``--steps`` repetitions of:

  local    Recorder.tensors(step, "params", local shards)     (what samebits recorded so far)
  global   Recorder.global_tensors(step, "params", params)    (the full tensors' digests)
  allreduce  one dist.all_reduce of the same int64 vector alone (the collective's share)

and the same for a bf16 layout with straddling words (odd row lengths split by columns).
Ratios are against `local` measured in the same run, so a loaded machine shifts both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_ms(fn, steps: int) -> float:
    times = []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn(step)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _worker(rank: int, world: int, port: int, steps: int, out: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import samebits
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    params = list(model.named_parameters())
    odd = [(f"odd{i}", distribute_tensor(torch.randn(257, 129).to(torch.bfloat16), mesh, [Shard(1)]))
           for i in range(4)]
    results = {}
    for label, named in (("tp_model", params), ("bf16_straddling", odd)):
        rec_local = samebits.Recorder(os.path.join(out, label, "local"), rank=rank, world_size=world)
        rec_global = samebits.Recorder(os.path.join(out, label, "global"), rank=rank, world_size=world)
        local = [(n, p.to_local()) for n, p in named]
        vector = torch.zeros(2 * len(named) + 2, dtype=torch.int64)
        numel = sum(p.numel() for _, p in named)
        row = {
            "tensors": len(named), "global_numel": numel,
            "local_ms": _median_ms(lambda s: (rec_local.tensors(s, "params", local), rec_local.end_step(s)), steps),
            "global_ms": _median_ms(lambda s: (rec_global.global_tensors(s, "params", named), rec_global.end_step(s)),
                                    steps),
            "allreduce_ms": _median_ms(lambda s: dist.all_reduce(vector), steps),
        }
        row["global_over_local"] = row["global_ms"] / row["local_ms"]
        results[label] = row
        rec_local.close()
        rec_global.close()
    if rank == 0:
        queue.put(results)
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(2, port, args.steps, out, queue), nprocs=2, start_method="spawn")
        results = queue.get()
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{'layout':<18} {'tensors':>7} {'numel':>9} {'local ms':>9} {'global ms':>10} {'ratio':>6} {'all-reduce ms':>14}")
    for label, row in results.items():
        print(f"{label:<18} {row['tensors']:>7} {row['global_numel']:>9} {row['local_ms']:>9.3f} "
              f"{row['global_ms']:>10.3f} {row['global_over_local']:>6.2f} {row['allreduce_ms']:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
