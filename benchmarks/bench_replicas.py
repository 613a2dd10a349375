"""`samebits.check_replicas` against the SHA-1-on-the-host approach, on the same model.

    python benchmarks/bench_replicas.py                  # 2 gloo ranks, a 48M-parameter model
    python benchmarks/bench_replicas.py --width 1024 --layers 4 --repeats 5 --json out.json

Baseline (what Megatron's ``--check-weight-hash-across-dp-replicas-interval`` does): every
parameter copied to the host, SHA-1 of its bytes there, the 20-byte hashes stacked and
all-gathered once over the data-parallel group, then compared.  samebits: `digest_many`
where the parameters live (on a GPU, only 8 bytes per tensor come to the host), one 8-byte
root per rank all-gathered, digests exchanged only if roots differ.  Both are timed on
equal replicas (the common case), median of ``--repeats`` calls, on every rank; the ratio is
baseline / samebits.  On this CPU machine "on the device" means the native CPU digest:
the host copy the baseline pays on a GPU is not in this ratio.
"""

from __future__ import annotations

import argparse
import hashlib
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

import samebits


def sha1_check(model: torch.nn.Module) -> bool:
    """The host-side baseline: SHA-1 of every parameter's bytes, all-gathered, compared."""
    hashes = [hashlib.sha1(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).digest()
              for p in model.parameters()]
    mine = torch.frombuffer(bytearray(b"".join(hashes)), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return all(torch.equal(everyone[0], other) for other in everyone[1:])


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, 4 * args.width), torch.nn.Linear(4 * args.width, args.width)]
    model = torch.nn.Sequential(*layers)
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    def timed(fn):
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    assert samebits.check_replicas(model).ok and sha1_check(model)  # warm-up, and both agree
    t_samebits = timed(lambda: samebits.check_replicas(model))
    t_sha1 = timed(lambda: sha1_check(model))
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as file:
            json.dump({"ranks": world, "parameters": sum(p.numel() for p in model.parameters()),
                       "tensors": len(list(model.parameters())), "bytes_per_rank": num_bytes,
                       "samebits_s": t_samebits, "sha1_host_s": t_sha1, "ratio": t_sha1 / t_samebits,
                       "samebits_gb_s": num_bytes / t_samebits / 1e9, "sha1_gb_s": num_bytes / t_sha1 / 1e9,
                       "load_avg": os.getloadavg()}, file)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_worker, args=(2, port, args, out), nprocs=2, join=True)
    result = json.load(open(out))
    os.unlink(out)
    text = json.dumps(result, indent=2)
    if args.json:
        open(args.json, "w").write(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
