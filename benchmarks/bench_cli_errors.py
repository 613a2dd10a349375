"""How long the command line takes to refuse a mistake, and to show or dump a small run
(issue 35 item 8: 9-12 s to say a run folder does not exist, 6 s for `show`).

    python benchmarks/bench_cli_errors.py            # median of 7 interleaved runs each
    python benchmarks/bench_cli_errors.py --runs 15 --json

Each command runs as a fresh process (`python -m samebits`, the interpreter of this
environment), interleaved with `python -c pass` so that load changes hit all of them alike.
Targets: an argument or path error <= 0.5 s, `show`/`dump` of a small run (2 ranks, 5 steps,
the tests' `write_run`) <= 1 s; both need the command to finish without importing torch
(tests/test_cli_fast_errors.py checks that, not the time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SAMEBITS = [sys.executable, "-m", "samebits"]


def commands(root: Path) -> dict[str, tuple[list[str], float | None]]:
    """label -> (argv, target seconds)."""
    run = str(root / "run")
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], None),
        "show MISSING (no such run directory)": ([*SAMEBITS, "show", str(root / "missing")], 0.5),
        "diff RUN MISSING": ([*SAMEBITS, "diff", run, str(root / "missing")], 0.5),
        "verify --resume-with CMD -- CMD (no --resume-at)": (
            [*SAMEBITS, "verify", "--resume-with", "python t.py", "--", "python", "t.py"], 0.5),
        "verify python t.py --out x (no --)": ([*SAMEBITS, "verify", "python", "t.py", "--out", "x"], 0.5),
        "show RUN": ([*SAMEBITS, "show", run], 1.0),
        "dump RUN --step 1": ([*SAMEBITS, "dump", run, "--step", "1"], 1.0),
    }


def wall_time(argv: list[str], cwd: Path) -> float:
    began = time.perf_counter()
    # errors exit 2, as expected; in the temporary folder, so that a samebits that does not refuse
    # the missing `--` (and runs verify with --out x) writes nothing outside it
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    return time.perf_counter() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="runs of each command (default 7)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from conftest import write_run  # the tests' small run: metrics, grads and params per step

        write_run(root / "run", world_size=2, num_steps=5)
        table = commands(root)
        times: dict[str, list[float]] = {label: [] for label in table}
        for _ in range(args.runs):
            for label, (argv, _) in table.items():
                times[label].append(wall_time(argv, root))
    medians = {label: statistics.median(values) for label, values in times.items()}
    if args.json:
        print(json.dumps({"runs": args.runs, "median_s": medians}, indent=2))
        return 0
    for label, (_, target) in table.items():
        verdict = "" if target is None else f"  (target <= {target:g} s: {'met' if medians[label] <= target else 'NOT met'})"
        print(f"{label:52s} {1000 * medians[label]:7.0f} ms{verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
