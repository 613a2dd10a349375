"""`samebits diff` on run pairs shaped like the seed's headline run (2,432 ranks x 800 steps).

    python benchmarks/bench_scale.py --records 16 32 64 --out /tmp/scale --json scale.json

For each size (records per step), writes the pair variants of gen_scale_runs.py (identical,
the last record of the last step of the last rank differing, one rank differing from step
3 on), runs `samebits diff` (the CLI's diff command, in a fresh process, with every integrity check) on
each, and reports wall time and peak memory: the comparing process's own peak RSS, and the
largest peak of its worker processes (parallel mode), so the total is at most
own + jobs x worker; and CPU seconds (the process and its workers: the cost that load on a
shared machine does not inflate).  Then deletes the runs.  ``--serial`` also times ``--jobs 1``.
Cost per byte is the figure that must stay flat across sizes (linear growth).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_scale_runs  # noqa: E402

_MEASURE = r"""
import argparse, json, resource, sys, time
from samebits.cli import diff as diff_command  # the `samebits diff` command alone
parser = argparse.ArgumentParser(prog="samebits")
diff_command.register(parser.add_subparsers())
start = time.perf_counter()
args = parser.parse_args(sys.argv[1:])
code = args.func(args)
wall = time.perf_counter() - start
sys.stdout.flush()
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"exit_code": code, "wall_s": wall,
                  "cpu_s": own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}),
      file=sys.stderr)
"""


def measure_diff(a: str, b: str, *extra: str) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", _MEASURE, "diff", a, b, *extra], capture_output=True, text=True)
    try:
        figures = json.loads(done.stderr.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise SystemExit(f"samebits diff {a} {b} failed (exit {done.returncode}):\n{done.stderr[-3000:]}") from None
    figures["process_wall_s"] = time.perf_counter() - started  # with Python and torch start-up
    figures["headline"] = done.stdout.splitlines()[1] if len(done.stdout.splitlines()) > 1 else done.stdout
    return figures


def bench_size(out: Path, num_records: int, num_ranks: int, num_steps: int, serial: bool) -> dict:
    started = time.perf_counter()
    info = gen_scale_runs.generate(out, num_ranks=num_ranks, num_steps=num_steps, num_records=num_records,
                                   progress=True)
    result = {"records_per_step": num_records, "ranks": num_ranks, "steps": num_steps,
              "bytes_per_run": info["bytes_per_run"], "generate_s": time.perf_counter() - started}
    paths = info["paths"]
    try:
        for label, other in (("identical", "b"), ("last_record", "b-last"), ("early_rank_step3", "b-early")):
            print(f"  diff {label} ...", file=sys.stderr)
            figures = measure_diff(paths["a"], paths[other])
            expected = 0 if label == "identical" else 1
            assert figures["exit_code"] == expected, figures
            figures["ns_per_byte"] = figures["wall_s"] * 1e9 / (2 * info["bytes_per_run"])
            figures["cpu_ns_per_byte"] = figures["cpu_s"] * 1e9 / (2 * info["bytes_per_run"])
            result[label] = figures
        if serial:
            figures = measure_diff(paths["a"], paths["b"], "--jobs", "1")
            figures["ns_per_byte"] = figures["wall_s"] * 1e9 / (2 * info["bytes_per_run"])
            figures["cpu_ns_per_byte"] = figures["cpu_s"] * 1e9 / (2 * info["bytes_per_run"])
            result["identical_serial"] = figures
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--ranks", type=int, default=gen_scale_runs.SEED_RANKS)
    parser.add_argument("--steps", type=int, default=gen_scale_runs.SEED_STEPS)
    parser.add_argument("--out", default="/tmp/samebits-scale")
    parser.add_argument("--serial", action="store_true", help="also time --jobs 1 on the identical pair")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)
    cores = len(os.sched_getaffinity(0))
    results = {"cores": cores, "load_avg_at_start": os.getloadavg(), "sizes": []}
    for num_records in args.records:
        print(f"{args.ranks} ranks x {args.steps} steps x {num_records} records:", file=sys.stderr)
        results["sizes"].append(bench_size(Path(args.out) / str(num_records), num_records, args.ranks,
                                           args.steps, args.serial))
        print(json.dumps(results["sizes"][-1], indent=1), file=sys.stderr)
    text = json.dumps(results, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
