"""Throughput of samebits.fingerprint digests against torch's own full-tensor reductions.

    python benchmarks/bench_digest.py            # table
    python benchmarks/bench_digest.py --json     # one JSON object (for benchmarks/RESULTS.md)
    python benchmarks/bench_digest.py --repeats 11 --threads 1

Single tensors: 256 MiB of float32 and of bfloat16, digest() against tensor.sum() (a memory
bound floor: one read of the data) and torch.hash_tensor (torch's XOR hash, which misses
permutations and pairs of equal flips).  Targets: >= 1.0x sum(), >= 2x hash_tensor.
Many tensors: 600 tensors of a model-like size mix (~400 MB) with one digest_many call against
a loop of digest() calls.  Every number is the median of --repeats timed runs after a warm-up,
all measured in the same process, the runs of the compared functions interleaved, with torch's thread count (--threads sets it; default:
torch's default, the number of cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from samebits.fingerprint import DIGEST_VERSION, _native, digest, digest_many

GIB = 1 << 30
SINGLE_TENSOR_BYTES = 256 << 20


def median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each function.  Repetitions are interleaved (a, b, c, a, b, c, ...)
    so that every function sees the same share of whatever else the machine is doing."""
    for fn in fns.values():
        fn()  # warm-up: first-touch page faults, lazy init, caches
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def machine_info() -> dict:
    """What a later reader needs to explain a different number: CPU, load, versions, commit."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "cpu": cpu,
        "num_cores": os.cpu_count(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "native": _native.describe(),
        "digest_version": DIGEST_VERSION,
        "commit": commit or "unknown",
    }


def model_like_tensors() -> list[torch.Tensor]:
    """600 float32 tensors, ~400 MB: 150 weight matrices and 450 bias/norm vectors."""
    generator = torch.Generator().manual_seed(0)
    tensors = []
    for i in range(150):
        tensors.append(torch.randn(1024, 640, generator=generator))  # 2.5 MiB each
        for size in (1024, 2048, 4096):
            tensors.append(torch.randn(size + i, generator=generator))  # odd sizes too
    return tensors


def run(repeats: int) -> dict:
    results: dict = {"machine": machine_info(), "single": []}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(SINGLE_TENSOR_BYTES // dtype.itemsize).to(dtype)
        seconds = median_seconds(
            {
                "digest": lambda: digest(x),
                "sum": lambda: x.sum(),
                "hash_tensor": lambda: torch.hash_tensor(x),
            },
            repeats,
        )
        gib_per_s = {name: x.nbytes / GIB / s for name, s in seconds.items()}
        results["single"].append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "bytes": x.nbytes,
                "gib_per_s": gib_per_s,
                "digest_vs_sum": gib_per_s["digest"] / gib_per_s["sum"],
                "digest_vs_hash_tensor": gib_per_s["digest"] / gib_per_s["hash_tensor"],
            }
        )
        del x

    tensors = model_like_tensors()
    total_bytes = sum(t.nbytes for t in tensors)
    seconds = median_seconds(
        {"many": lambda: digest_many(tensors), "loop": lambda: [digest(t) for t in tensors]},
        repeats,
    )
    many, loop = seconds["many"], seconds["loop"]
    results["many"] = {
        "num_tensors": len(tensors),
        "bytes": total_bytes,
        "digest_many_ms": many * 1e3,
        "digest_loop_ms": loop * 1e3,
        "digest_many_gib_per_s": total_bytes / GIB / many,
        "digest_loop_gib_per_s": total_bytes / GIB / loop,
        "speedup": loop / many,
    }
    return results


def format_table(results: dict) -> str:
    machine = results["machine"]
    lines = [
        f"{machine['cpu']} ({machine['num_cores']} cores, load {machine['load_average_1min']:.1f}"
        f" at start), torch {machine['torch']}, {machine['num_threads']} threads, "
        f"digest version {machine['digest_version']}, library {machine['native']}, commit {machine['commit']}",
        "",
        f"{'tensor':<18} {'digest':>9} {'sum()':>9} {'hash_tensor':>12} "
        f"{'vs sum':>8} {'vs hash':>8}   (GiB/s)",
    ]
    for row in results["single"]:
        rate = row["gib_per_s"]
        lines.append(
            f"{row['dtype'] + ' 256 MiB':<18} {rate['digest']:>9.1f} {rate['sum']:>9.1f} "
            f"{rate['hash_tensor']:>12.1f} {row['digest_vs_sum']:>7.2f}x "
            f"{row['digest_vs_hash_tensor']:>7.2f}x"
        )
    many = results["many"]
    lines += [
        "",
        f"{many['num_tensors']} tensors, {many['bytes'] / 1e6:.0f} MB: digest_many "
        f"{many['digest_many_ms']:.1f} ms ({many['digest_many_gib_per_s']:.1f} GiB/s), "
        f"digest() loop {many['digest_loop_ms']:.1f} ms ({many['digest_loop_gib_per_s']:.1f} "
        f"GiB/s), {many['speedup']:.2f}x",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per number (median)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (samebits follows it)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    results = run(args.repeats)
    print(json.dumps(results, indent=2) if args.json else format_table(results))


if __name__ == "__main__":
    main()
