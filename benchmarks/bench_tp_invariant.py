"""TP-invariant linear layers (samebits.invariant, tp_reduce=invariant): time and accuracy.

    python benchmarks/bench_tp_invariant.py layer [--tokens 1024] [--dim 256] [--hidden 1024] [--rounds 7]
    python benchmarks/bench_tp_invariant.py accuracy [--tokens 512] [--dim 1024] [--out-dim 256]
    python benchmarks/bench_tp_invariant.py recipe [--steps 12] [--rounds 3] [--cell single|tp2]

layer (one process, 1 thread): an MLP's two linears, column-parallel up (dim -> hidden) and
row-parallel down (hidden -> dim), forward and backward on (tokens, dim) fp32: plain
`F.linear` versus `column_parallel_linear` / `row_parallel_linear` at tp=1 (no collective:
the arithmetic alone) in the default mode "gemm" (platform GEMM leaves, one fixed tree) and
in mode "exact" (exact block products), the three alternating within each round.  Each round
gives a ratio to plain; printed: the median over rounds and its range (min-max).

accuracy: `tree_matmul` (mode gemm), `invariant_matmul` (mode exact) and torch's fp32 GEMM
against the fp64 product, on normal data and on squared-ReLU activations (many zeros, a wide
range inside a block): the median and 99th-percentile distance in fp32 ulps from the fp64
product rounded to fp32, and the largest error relative to the bound sum_k |a_mk| |b_kn|.

recipe: the reference recipe (ep=1), whole-step time with tp_reduce=invariant versus plain at
the same layout, alternating runs; each round's ratio is the median of its invariant steps
over the median of its plain steps (the first 3 steps of each run left out); printed: the
median over rounds and its range.  Beside it the CPU time a step costs (a run of --steps
minus a run of 3, over the steps between; both ranks' under tp2): on a shared machine the
wall time also counts waiting for a core.  --cell single (one process, in-process runs) also
times mode "exact"; --cell tp2 runs each as one torchrun of 2 ranks (gloo, OMP_NUM_THREADS=1).
Every line carries the load average (`uptime`) at its start and end: the machine is shared.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from samebits.invariant import column_parallel_linear, invariant_matmul, row_parallel_linear
from samebits.invariant import tree_matmul


def _load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def _ratios(per_round: dict[str, list[float]], name: str) -> str:
    ratios = [inv / plain for inv, plain in zip(per_round[name], per_round["plain"])]
    return (f"{name} {1000 * statistics.median(per_round[name]):.1f} ms: {statistics.median(ratios):.2f}x "
            f"(rounds {min(ratios):.2f}-{max(ratios):.2f}x)")


def _mlp_step(x, w_up, w_down, grad, up, down) -> None:
    for w in (x, w_up, w_down):
        w.grad = None
    y = down(F.relu(up(x, w_up)).square(), w_down)
    y.backward(grad)


def layer(args) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.dim, generator=gen, requires_grad=True)
    w_up = (torch.randn(args.hidden, args.dim, generator=gen) * 0.05).requires_grad_()
    w_down = (torch.randn(args.dim, args.hidden, generator=gen) * 0.05).requires_grad_()
    grad = torch.randn(args.tokens, args.dim, generator=gen)

    def mode(name):
        return (lambda a, w: column_parallel_linear(a, w, mode=name)), (lambda a, w: row_parallel_linear(a, w, mode=name))

    variants = {"plain": (F.linear, F.linear), "gemm": mode("gemm"), "exact": mode("exact")}
    start_load = _load()
    per_round: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (up, down) in variants.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                _mlp_step(x, w_up, w_down, grad, up, down)
                times.append(time.perf_counter() - start)
            per_round[name].append(statistics.median(times))
    print(f"MLP fwd+bwd, tokens={args.tokens} dim={args.dim} hidden={args.hidden}, 1 thread, {args.rounds} rounds "
          f"of {args.repeats}: plain {1000 * statistics.median(per_round['plain']):.1f} ms; "
          f"{_ratios(per_round, 'gemm')}; {_ratios(per_round, 'exact')} [{start_load} -> {_load()}]")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def ordered(x):
        i = x.view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs().double()


def accuracy(args) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(args.tokens, args.dim, generator=gen)
    b = torch.randn(args.dim, args.out_dim, generator=gen) * 0.05
    for label, left in (("normal", a), ("squared ReLU", F.relu(a).square())):
        reference = left.double() @ b.double()
        bound = left.double().abs() @ b.double().abs()
        for name, out in (("torch fp32", left @ b), ("gemm (tree)", tree_matmul(left, b)),
                          ("exact", invariant_matmul(left, b))):
            ulps = _ulps(out, reference.float())
            rel = ((out.double() - reference).abs() / bound).max()
            print(f"{label:>13}, K={args.dim}: {name:>11}: median {ulps.median():.0f} ulp, "
                  f"p99 {ulps.quantile(0.99):.0f} ulp, max error / bound {rel:.2e}")


def _in_process(name: str, steps: int) -> tuple[list[float], float]:
    """(step wall times after the first 3, CPU seconds of the process over the run)."""
    from samebits.recipes import RecipeConfig, parallelize
    from samebits.recipes.loop import train

    parallelize.TP_MATMUL_MODE = "exact" if name == "exact" else "gemm"
    start = time.process_time()
    try:
        result = train(RecipeConfig(ep=1, tp_reduce="plain" if name == "plain" else "invariant"), steps=steps)
    finally:
        parallelize.TP_MATMUL_MODE = "gemm"
    return [m["step_time_s"] for m in result.metrics[3:]], time.process_time() - start


def _torchrun(name: str, steps: int) -> tuple[list[float], float]:
    """(step wall times after the first 3, CPU seconds of both ranks and the launcher)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "-m", "samebits.recipes", "--cell", "tp2", "--steps", str(steps), "--set", "ep=1",
            "--set", f"tp_reduce={'plain' if name == 'plain' else 'invariant'}"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    lines = [x for x in done.stdout.splitlines() if x.startswith("step ")]
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return [float(x.rsplit("|", 1)[1].split()[0]) / 1000 for x in lines[3:]], cpu


def recipe(args) -> None:
    """Wall: each round's median step.  CPU: a run of --steps minus a run of 3 steps (start-up,
    warm-up), divided by the steps between: what the step costs the cores, less moved by the
    other jobs of a shared machine than the wall time (waiting for a core is not counted)."""
    names = ("plain", "gemm", "exact") if args.cell == "single" else ("plain", "gemm")
    run = _in_process if args.cell == "single" else _torchrun
    if args.steps <= 3:
        raise SystemExit("recipe: --steps must be above 3 (the first 3 steps of each run are left out)")
    run("plain", 3)  # one-time costs (imports, first allocations) out of the first timed run
    start_load = _load()
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            times, cpu_long = run(name, args.steps)
            _, cpu_short = run(name, 3)
            wall[name].append(statistics.median(times))
            cpu[name].append((cpu_long - cpu_short) / (args.steps - 3))
    where = "one rank" if args.cell == "single" else "tp2 (2 ranks, gloo, 1 thread each)"
    print(f"recipe at {where} (defaults, ep=1), {args.steps} steps x {args.rounds} rounds: wall: plain "
          f"{1000 * statistics.median(wall['plain']):.1f} ms a step; tp_reduce=invariant "
          + "; ".join(_ratios(wall, name) for name in names[1:])
          + f" | CPU: plain {1000 * statistics.median(cpu['plain']):.1f} ms a step; "
          + "; ".join(_ratios(cpu, name) for name in names[1:]) + f" [{start_load} -> {_load()}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layer")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeats", type=int, default=3, help="steps timed per variant per round (median)")
    p = sub.add_parser("accuracy")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--out-dim", type=int, default=256)
    p = sub.add_parser("recipe")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cell", choices=("single", "tp2"), default="single")
    args = parser.parse_args()
    {"layer": layer, "accuracy": accuracy, "recipe": recipe}[args.command](args)


if __name__ == "__main__":
    main()
