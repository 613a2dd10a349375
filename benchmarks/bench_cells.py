"""Step time of the reference recipe in each parallel cell, and of the default 2-rank run
before and after the move to PyTorch's parallel engines.

    python benchmarks/bench_cells.py [--steps 8] [--cells dp2,tp2,...] [--baseline REV]

Each cell runs once under torchrun (OMP_NUM_THREADS=1, the tiny model of the cell tests:
2 blocks, seq_len 32, micro-batch 2) and the figure is the median of the step times the
recipe prints, first two steps (warm-up, pipeline set-up) excluded.  With `--baseline REV`,
the default config on 2 ranks (DP + EP, the `samebits verify` job) alternates between this
tree and a `git archive` of REV, three rounds each, so both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from samebits.recipes import ParallelDims, parse_cell

REPO = Path(__file__).resolve().parents[1]
CELLS = ["dp2", "fsdp2", "tp2", "pp2", "ep2", "tp2-dp2", "tp2-ep2", "tp2-pp2", "fsdp2-tp2",
         "pp2-dp2", "dp4", "fsdp4"]
TINY = ["num_layers=2", "seq_len=32", "micro_batch_size=2"]
STEP_MS = re.compile(r"^step +(\d+) .*\| (\d+) ms$", re.M)


def _world(cell: str) -> int:
    return ParallelDims(**parse_cell(cell)).world_size


def _run(module: str, nproc: int, args: list[str], steps: int, pythonpath: str | None) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(29700 + os.getpid() % 200), "-m", module, "--steps", str(steps),
           *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    times = [int(ms) for step, ms in STEP_MS.findall(done.stdout) if int(step) >= 2]
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cells", default=",".join(CELLS))
    parser.add_argument("--baseline", metavar="REV", help="compare the default 2-rank run with REV")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    results: dict = {"cells": {}}
    for cell in args.cells.split(","):
        sets = [a for s in TINY for a in ("--set", s)]
        results["cells"][cell] = _run("samebits.recipes", _world(cell), ["--cell", cell, *sets],
                                      args.steps, None)
        print(f"{cell:10s} {results['cells'][cell]:6.0f} ms/step", file=sys.stderr)

    if args.baseline:
        old = Path(tempfile.mkdtemp(prefix="bench_cells_"))
        try:
            archive = subprocess.run(["git", "-C", str(REPO), "archive", args.baseline, "src"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
            for lib in (REPO / "src/samebits/fingerprint").glob("_libdigest*"):
                shutil.copy(lib, old / "src/samebits/fingerprint")  # the built C digest
            module_of = {"new": ("samebits.recipes", None),
                         "old": ("samebits.recipes.train", str(old / "src"))}
            rounds: dict[str, list[float]] = {"new": [], "old": []}
            for _ in range(3):
                for label, (module, path) in module_of.items():
                    rounds[label].append(_run(module, 2, [], args.steps, path))
            results["default_2_ranks_ms"] = {k: statistics.median(v) for k, v in rounds.items()}
            results["default_2_ranks_rounds"] = rounds
            results["ratio_new_over_old"] = (results["default_2_ranks_ms"]["new"]
                                             / results["default_2_ranks_ms"]["old"])
        finally:
            shutil.rmtree(old, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for cell, ms in results["cells"].items():
            print(f"| {cell} | {_world(cell)} | {ms:.0f} |")
        if args.baseline:
            print(f"default, 2 ranks: {results['default_2_ranks_ms']} "
                  f"ratio {results['ratio_new_over_old']:.2f}")


if __name__ == "__main__":
    main()
