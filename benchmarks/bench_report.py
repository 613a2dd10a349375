"""What `samebits report` costs next to `samebits diff` on the same two runs, and the page size.

    python benchmarks/bench_report.py --ranks 8 --steps 200 --tensors 20

Writes two runs (Recorder, one process per rank written in turn) that differ from step
``--plant-step`` on rank 3, then times `samebits.diff` (the baseline, measured in the same
run) and `build_report` (which runs that diff, walks every rank to its own first divergence,
reads the steps it draws and decodes the records of the tables and curves).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import samebits
from samebits.runners.report import build_report


def write(root: Path, label: str, ranks: int, steps: int, tensors: int, plant_step: int) -> Path:
    for rank in range(ranks):
        rec = samebits.Recorder(root / label, rank=rank, world_size=ranks, config={"bench": True})
        for step in range(steps):
            values = [torch.full((1024,), float(step + rank + i)) for i in range(tensors)]
            if label == "b" and rank == 3 % ranks and step >= plant_step:
                values[0] = values[0] + 1e-3
            rec.metrics(step, loss=values[0].sum() * 1e-3, lr=1e-3, grad_norm=values[1].norm())
            rec.tensors(step, "params", [(f"layer{i}.weight", v) for i, v in enumerate(values)])
        rec.close()
    return root / label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--plant-step", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        a = write(root, "a", args.ranks, args.steps, args.tensors, args.plant_step)
        b = write(root, "b", args.ranks, args.steps, args.tensors, args.plant_step)
        diff_s, report_s, size = [], [], 0
        for _ in range(args.repeats):
            began = time.perf_counter()
            samebits.diff(a, b)
            diff_s.append(time.perf_counter() - began)
            began = time.perf_counter()
            report = build_report([a, b])
            report_s.append(time.perf_counter() - began)
            size = len(report.html.encode())
        print(f"{args.ranks} ranks x {args.steps} steps x {args.tensors} tensors (+3 metrics), differing from step "
              f"{args.plant_step} on rank 3")
        print(f"diff:   best {min(diff_s):.3f} s")
        print(f"report: best {min(report_s):.3f} s  ({min(report_s) / min(diff_s):.1f}x diff), page {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
