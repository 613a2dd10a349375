"""What samebits' torchtitan config costs: the same torchtitan command with and without it, per layout.

    python benchmarks/bench_torchtitan_invariant.py [--layouts single,fsdp2,dp2,tp2,fsdp2-tp2] [--steps 20] [--rounds 3]
        [--config tiny_invariant] [--json]

Each layout runs torchtitan 0.3.0's llama3 debug model (2 layers, SDPA, CPU, gloo; the
`tiny_invariant` config of tests/realcode/torchtitan, or `tiny_invariant_dp`: torchtitan's own
layers, data-parallel invariance only) through its own entry point, once with
samebits' config (`SAMEBITS_INVARIANT=1`) and once without (`=0`: torchtitan's own step at the
same layout, global batch and data), the order alternating per round, nothing recorded and no
checkpoint.  A run's time is its training loop's: from torchtitan's log line of step 2 to that of
the last step (the first step, with its warm-up, left out), so start-up and imports are not in it.
Printed per layout: the median of the per-round ratios (with the config / without), the min-max,
the median seconds per step of each, and the 1-minute load average after each round (the
machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from samebits.runners.commands import cell_degrees

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tests" / "realcode" / "torchtitan" / "launch.py"
_STEP = re.compile(r"^\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?step:\s+(\d+)\s")


def ranks(cell: str) -> int:
    return math.prod(cell_degrees(cell).values())


def train_seconds(cell: str, invariant: bool, steps: int, work: Path, config: str = "tiny_invariant") -> float:
    """One run's training loop: seconds from torchtitan's step-2 log line to its last step's."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks(cell)),
            str(LAUNCH), "--module", "tiny_llama3", "--config", config, "--dump_folder", str(work),
            "--training.steps", str(steps), "--checkpoint.no-enable", "--metrics.log_freq", "1"]
    env = {**os.environ, "SAMEBITS_LAYOUT": cell, "SAMEBITS_INVARIANT": "1" if invariant else "0",
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{cell} ({'with' if invariant else 'without'} the config) failed:\n{proc.stderr[-3000:]}")
    stamps: dict[int, datetime] = {}
    for line in (proc.stdout + proc.stderr).splitlines():
        match = _STEP.search(re.sub(r"\x1b\[[0-9;]*m", "", line))
        if match:
            stamps.setdefault(int(match.group(2)), datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    if 2 not in stamps or steps not in stamps:
        raise SystemExit(f"{cell}: torchtitan's log holds no step 2 or step {steps} line (steps logged: "
                         f"{sorted(stamps)}); is its metrics log_freq 1?")
    return (stamps[steps] - stamps[2]).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="single,fsdp2,dp2,tp2,fsdp2-tp2")
    parser.add_argument("--config", default="tiny_invariant", choices=("tiny_invariant", "tiny_invariant_dp"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cell in layouts:
            ratios, with_s, without_s, loads = [], [], [], []
            for round_ in range(args.rounds):
                order = (True, False) if round_ % 2 == 0 else (False, True)
                times = {}
                for invariant in order:
                    times[invariant] = train_seconds(cell, invariant, args.steps,
                                                     Path(tmp) / f"{cell}-{round_}-{int(invariant)}", args.config)
                ratios.append(times[True] / times[False])
                with_s.append(times[True] / (args.steps - 2))
                without_s.append(times[False] / (args.steps - 2))
                loads.append(round(os.getloadavg()[0], 2))
                print(f"  {cell} round {round_ + 1}/{args.rounds}: {ratios[-1]:.3f}x", file=sys.stderr, flush=True)
            results[cell] = {"ratio_median": statistics.median(ratios), "ratio_min_max": [min(ratios), max(ratios)],
                             "ratios": ratios, "step_s_with": statistics.median(with_s),
                             "step_s_without": statistics.median(without_s), "load_1min_after_rounds": loads}
    if args.json:
        print(json.dumps({"config": args.config, "steps": args.steps, "rounds": args.rounds, "layouts": results},
                         indent=2))
        return
    print(f"samebits' torchtitan config ({args.config}) vs the same command without it ({args.steps} steps, step 2 to "
          f"{args.steps} timed, {args.rounds} rounds)")
    print(f"{'layout':<8} {'ratio (median)':>14} {'min-max':>15} {'s/step with':>12} {'s/step without':>15}  load")
    for cell, r in results.items():
        print(f"{cell:<8} {r['ratio_median']:>13.3f}x {r['ratio_min_max'][0]:>7.3f}-{r['ratio_min_max'][1]:<7.3f}"
              f" {r['step_s_with']:>12.3f} {r['step_s_without']:>15.3f}  {r['load_1min_after_rounds']}")


if __name__ == "__main__":
    main()
