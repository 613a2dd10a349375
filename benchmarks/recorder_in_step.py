"""Why a recorded step costs more inside a training step than in a tight loop (issue 16).

    python benchmarks/recorder_in_step.py cold [--steps 60]
    python benchmarks/recorder_in_step.py digest-after [--repeats 60]

``cold``: small operations the Recorder used to make per step (a ctypes call, SHA-256 and CRC-32
of a 2 KiB step, a 2 KiB file write, a small tensor, a numpy concatenate, a bytearray), each
timed as the first call after a training step of the reference recipe and again right after:
the first call pays for code and data the step evicted.

``digest-after``: the native digest of tensors shaped like the recipe's parameters and
gradients (76 tensors, 3 MB, one call, addresses given) after writing N MB of other memory:
in cache, from the last-level cache, from DRAM.

OMP_NUM_THREADS=1 for both (the recipe benchmark's setting).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import tempfile
import time
import zlib
from array import array

import numpy as np
import torch

from samebits.fingerprint import _native
from samebits.recipes import RecipeConfig, session
from samebits.recipes.loop import _Run


def cold(steps: int) -> None:
    data = bytes(2079)  # a recipe step's records, about
    fd, path = tempfile.mkstemp()
    a, b = np.zeros(38, np.int64), np.zeros(38, np.int64)
    ops = {
        "ctypes call (trivial)": lambda: _native.LIB.samebits_digest_abi_version(),
        "hashlib.sha256, 2 KiB": lambda: hashlib.sha256(data).digest(),
        "zlib.crc32, 2 KiB": lambda: zlib.crc32(data),
        "os.write, 2 KiB": lambda: os.write(fd, data),
        "torch.empty(38)": lambda: torch.empty(38, dtype=torch.int64),
        "np.concatenate, 2 x 38": lambda: np.concatenate([a, b]),
        "bytearray, 2 KiB": lambda: bytearray(data),
    }
    cfg = RecipeConfig()
    names = list(ops)
    first = {k: [] for k in names}
    again = {k: [] for k in names}
    with session(cfg):
        run = _Run(cfg, 0, 1)
        for _ in range(3):
            run.train_step(None)
            run.step += 1
        for i in range(steps * len(names)):
            run.train_step(None)
            run.step += 1
            name = names[i % len(names)]
            start = time.perf_counter()
            ops[name]()
            first[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            ops[name]()
            again[name].append(time.perf_counter() - start)
    os.close(fd)
    os.unlink(path)
    print(f"{'operation':<26} {'first after a step':>19} {'again':>8}   (median us, {steps} steps each)")
    for name in names:
        print(f"{name:<26} {1e6 * statistics.median(first[name]):>19.1f} {1e6 * statistics.median(again[name]):>8.1f}")


def digest_after(repeats: int) -> None:
    sizes = [64] * 13 + [256] * 2 + [4096] * 5 + [8192] + [12288] * 5 + [16384] * 6 + [32768] * 6  # the recipe's
    tensors = [torch.randn(n) for n in sizes] + [torch.randn(n) for n in sizes]  # params and grads
    pointers = [t.data_ptr() for t in tensors]
    num_bytes = array("Q", [t.nbytes for t in tensors])
    out = np.zeros(len(tensors), dtype=np.uint64)
    total = sum(num_bytes)
    print(f"{len(tensors)} tensors, {total / 1e6:.2f} MB, one native call ({_native.describe()})")
    for mib in (0, 2, 8, 24, 64, 256):
        other = torch.ones(mib * 2**18 + 1)
        times = []
        for _ in range(repeats):
            other.add_(1.0)  # write `mib` MiB of other memory
            start = time.perf_counter()
            _native.body_sums_into(pointers, num_bytes, out.ctypes.data)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(f"after writing {mib:>3} MiB of other memory: {1e6 * median:7.1f} us ({total / median / 1e9:5.1f} GB/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["cold", "digest-after"])
    parser.add_argument("--steps", type=int, default=60, help="cold: training steps per operation")
    parser.add_argument("--repeats", type=int, default=60, help="digest-after: digests per memory size")
    args = parser.parse_args()
    if not _native.available():
        raise SystemExit("the compiled digest library is not built: pip install -e .")
    cold(args.steps) if args.what == "cold" else digest_after(args.repeats)


if __name__ == "__main__":
    main()
