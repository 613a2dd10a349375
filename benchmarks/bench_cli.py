"""How long the command line takes to print its help: `samebits --help` and `samebits verify
--help`, each against `python -c pass` (the interpreter's own start-up) measured in the same run.

    python benchmarks/bench_cli.py            # median of 15 interleaved runs each
    python benchmarks/bench_cli.py --runs 31 --json

Help needs no part of the library that loads torch (cli/_lazy.py); the target is at most 0.5 s
for `samebits --help` here.  Each command runs as a fresh process (`python -m samebits`, the
interpreter of this environment), interleaved so load changes hit all of them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "samebits --help": [sys.executable, "-m", "samebits", "--help"],
    "samebits verify --help": [sys.executable, "-m", "samebits", "verify", "--help"],
}
TARGET_S = 0.5


def wall_time(command: list[str]) -> float:
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs of each command (default 15)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args()
    times: dict[str, list[float]] = {label: [] for label in COMMANDS}
    for label, command in COMMANDS.items():  # one untimed run each: the file cache, compiled bytecode
        wall_time(command)
    for _ in range(args.runs):
        for label, command in COMMANDS.items():
            times[label].append(wall_time(command))
    medians = {label: statistics.median(values) for label, values in times.items()}
    baseline = medians["python -c pass"]
    if args.json:
        print(json.dumps({"runs": args.runs, "median_s": medians, "target_s": TARGET_S}, indent=2))
    else:
        for label, median in medians.items():
            print(f"{label:24s} median {1000 * median:7.1f} ms  ({median / baseline:5.1f}x python -c pass)")
        verdict = "met" if medians["samebits --help"] <= TARGET_S else "NOT met"
        print(f"target: samebits --help <= {TARGET_S} s: {verdict} ({args.runs} runs each, interleaved)")
    return 0 if medians["samebits --help"] <= TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
