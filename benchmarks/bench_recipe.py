"""Recorder overhead on the reference recipe: step time with recording on versus off.

    python benchmarks/bench_recipe.py [--steps 30] [--rounds 3] [--json]

One process (world size 1), the default recipe config.  "on" records what the recipe
records every step (tokens, block outputs and logits, metrics, every gradient, every
parameter) and ends the step; "off" passes no recorder.  Rounds alternate on/off so both
see the same machine; the figure is the median step time over all rounds, first steps of
each run (warm-up) excluded.  Target: overhead under 2% of step time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

import samebits
from samebits.recipes import train
from samebits.recipes.config import RecipeConfig

WARMUP_STEPS = 3


def step_times(steps: int, record: bool) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="samebits-bench-"))
    try:
        recorder = samebits.Recorder(root, rank=0, world_size=1) if record else None
        result = train(RecipeConfig(), steps=steps, recorder=recorder)
        if recorder is not None:
            recorder.close()
        return [m["step_time_s"] for m in result.metrics[WARMUP_STEPS:]]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    times = {"off": [], "on": []}
    for _ in range(args.rounds):
        for mode in ("off", "on"):
            times[mode] += step_times(args.steps, record=mode == "on")
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    result = {"torch": torch.__version__, "steps_per_run": args.steps, "rounds": args.rounds,
              "step_ms_off": off * 1e3, "step_ms_on": on * 1e3, "overhead": on / off - 1}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"recipe step time: recording off {off * 1e3:.2f} ms, on {on * 1e3:.2f} ms "
              f"-> overhead {100 * (on / off - 1):+.1f}% (target < 2%)")


if __name__ == "__main__":
    main()
