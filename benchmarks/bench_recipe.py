"""Recorder overhead on the reference recipe: step time with recording on versus off.

    python benchmarks/bench_recipe.py [--steps 30] [--rounds 3] [--json]

One process (world size 1), the default recipe config.  "off" passes no recorder;
"params+grads" fingerprints every gradient and parameter each step (the issue's measure);
"everything" records all the recipe records (tokens, block outputs and logits, metrics,
gradients, parameters).  Two more rows split the overhead: "no-op recorder" (the recipe's
own recording code with a recorder that does nothing) and "digest only" (the same plus one
batched `body_sums` of grads and of params, nothing written).  Rounds alternate the modes so all see the same machine; the figure
is the median step time over all rounds, first steps of each run (warm-up) excluded.
Target: params+grads overhead under 2% of step time.
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
from samebits.fingerprint import body_sums
from samebits.recipes import train
from samebits.recipes.config import RecipeConfig

WARMUP_STEPS = 3


class _NoOpRecorder:
    """The recorder interface the recipe calls, doing nothing: isolates the recipe's own cost."""

    def tensors(self, step, phase, named_tensors):
        pass

    def metrics(self, step, **values):
        pass

    def end_step(self, step):
        return None

    def close(self):
        pass


class _DigestOnly(_NoOpRecorder):
    def tensors(self, step, phase, named_tensors):
        if phase in ("grads", "params"):
            body_sums([t for _, t in named_tensors])


MODES = {
    "off": lambda root: None,
    "no-op recorder": lambda root: _NoOpRecorder(),
    "digest only": lambda root: _DigestOnly(),
    "params+grads": lambda root: samebits.Recorder(root, rank=0, world_size=1, phases="grads,params"),
    "everything": lambda root: samebits.Recorder(root, rank=0, world_size=1),
}


def step_times(steps: int, mode: str) -> list[float]:
    root = Path(tempfile.mkdtemp(prefix="samebits-bench-"))
    try:
        recorder = MODES[mode](root)
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
    times = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode] += step_times(args.steps, mode)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    result = {"torch": torch.__version__, "steps_per_run": args.steps, "rounds": args.rounds,
              "step_ms": {m: v * 1e3 for m, v in medians.items()},
              "overhead": {m: medians[m] / medians["off"] - 1 for m in MODES if m != "off"}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{'recording':<14} {'step (ms)':>10} {'overhead':>9}")
    for mode, value in medians.items():
        overhead = "-" if mode == "off" else f"{100 * (value / medians['off'] - 1):+.1f}%"
        print(f"{mode:<14} {value * 1e3:>10.2f} {overhead:>9}")
    print("target: params+grads overhead < 2%")


if __name__ == "__main__":
    main()
