"""Times body loops against torch's x.sum() on one float32 buffer, in one process, interleaved.

    python benchmarks/digest_mca/time_loops.py candidates [--repeats 9]     # phase-1 loops
    python benchmarks/digest_mca/time_loops.py streams [--repeats 21]       # phase-2: streams
    python benchmarks/digest_mca/time_loops.py versions [--threads 2]       # v1 vs v2 library
    python benchmarks/digest_mca/time_loops.py versions --old-commit 34a23eb # one stream vs four

`candidates` and `streams` compile candidates.c (gcc -O3 -march=x86-64-v3) into a temp dir; `versions`
builds digest.c of an older commit (--old-commit; default: the last of digest version 1) the way setup.py does and
loads it beside the installed version-2 library.  Each number is the median of --repeats
rounds (each round times every loop once, in turn), after a warm-up.  --bytes sets the buffer
size (default 256 MiB: DRAM-bound; 1.5 MB stays in cache); small buffers are timed in batches.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CANDIDATES = ["u64_sum", "fmix_v1", "mix2_no_prefetch", "mix2_prefetch_2k", "mix2_prefetch_4k",
              "mix2_prefetch_8k", "feistel4"]
STREAMS = ["load_1s", "load_2s", "load_4s", "mix2_1s_2k", "mix2_2s_2k", "mix2_4s_1k", "mix2_4s_2k",
           "mix2_4s_4k", "mix2_8s_2k", "rot4_4s_2k"]


def build(source: Path, out: Path, flags: list[str]) -> ctypes.CDLL:
    subprocess.run(["gcc", "-O3", "-std=c11", "-fPIC", "-shared", *flags, "-o", str(out), str(source)], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["candidates", "streams", "versions"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bytes", type=int, default=256 << 20)
    parser.add_argument("--old-commit", "--v1-commit", dest="old_commit", default="940be0e~1",
                        help="the commit whose digest.c to time beside the installed library (default: the last of digest version 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(args.bytes // 4)
    batch = max(1, (64 << 20) // x.nbytes)  # small buffers: time several calls per sample
    loops = {"torch_sum": x.sum}
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode in ("candidates", "streams"):
            lib = build(HERE / "candidates.c", Path(tmp) / "candidates.so", ["-march=x86-64-v3"])
            for name in CANDIDATES if args.mode == "candidates" else STREAMS:
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_uint64]
                loops[name] = (lambda fn=fn: fn(x.data_ptr(), x.nbytes // 8))
        else:
            source = Path(tmp) / "digest_old.c"
            source.write_text(subprocess.run(["git", "show", f"{args.old_commit}:src/samebits/fingerprint/csrc/digest.c"],
                                             cwd=ROOT, capture_output=True, text=True, check=True).stdout)
            libs = {f"old {args.old_commit}": build(source, Path(tmp) / "old.so", ["-fvisibility=hidden", "-fopenmp"]),
                    "installed": ctypes.CDLL(next((ROOT / "src/samebits/fingerprint").glob("_libdigest*.so")))}
            pointers = (ctypes.c_uint64 * 1)(x.data_ptr())
            sizes = (ctypes.c_uint64 * 1)(x.nbytes)
            out = (ctypes.c_uint64 * 1)()
            for name, lib in libs.items():
                lib.samebits_body_sums.restype = None
                loops[name] = (lambda lib=lib: lib.samebits_body_sums(1, pointers, sizes, out, args.threads))
        for loop in loops.values():
            loop()  # warm-up: page faults, caches
        times = {name: [] for name in loops}
        for _ in range(args.repeats):
            for name, loop in loops.items():
                start = time.perf_counter()
                for _ in range(batch):
                    loop()
                times[name].append((time.perf_counter() - start) / batch)
    base = statistics.median(times["torch_sum"])
    print(f"{x.nbytes / 2**20:.1f} MiB float32, {args.threads} thread(s), median of {args.repeats}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:18s} {x.nbytes / 2**30 / median:6.2f} GiB/s  {base / median:5.2f}x sum")


if __name__ == "__main__":
    main()
