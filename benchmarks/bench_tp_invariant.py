"""TP-invariant linear layers (samebits.invariant, tp_reduce=invariant): time and accuracy.

    python benchmarks/bench_tp_invariant.py layer [--tokens 1024] [--dim 256] [--hidden 1024] [--rounds 7]
    python benchmarks/bench_tp_invariant.py accuracy [--tokens 512] [--dim 1024] [--out-dim 256]
    python benchmarks/bench_tp_invariant.py recipe [--steps 12] [--rounds 3]

layer (one process, 1 thread): an MLP's two linears, column-parallel up (dim -> hidden) and
row-parallel down (hidden -> dim), forward and backward on (tokens, dim) fp32: plain
`F.linear` versus `column_parallel_linear` / `row_parallel_linear` at tp=1 (no collective:
the arithmetic alone), alternating, median of --rounds; the ratio is the figure.

accuracy: `invariant_matmul` and torch's fp32 GEMM against the fp64 product, on normal data
and on squared-ReLU activations (many zeros, a wide range inside a block): the median and
99th-percentile distance in fp32 ulps from the fp64 product rounded to fp32, and the largest
error relative to the bound sum_k |a_mk| |b_kn| (what a GEMM error analysis bounds).

recipe (one process): the reference recipe on one rank (ep=1), whole-step time with
tp_reduce=invariant versus plain, alternating runs; median of the step times after the
first 3 steps of each run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from samebits.invariant import column_parallel_linear, invariant_matmul, row_parallel_linear


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
    variants = {"plain": (F.linear, F.linear),
                "invariant": (column_parallel_linear, row_parallel_linear)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (up, down) in variants.items():
            start = time.perf_counter()
            _mlp_step(x, w_up, w_down, grad, up, down)
            times[name].append(time.perf_counter() - start)
    plain, inv = (statistics.median(times[n]) for n in ("plain", "invariant"))
    print(f"MLP fwd+bwd, tokens={args.tokens} dim={args.dim} hidden={args.hidden}, 1 thread: "
          f"plain {1000 * plain:.1f} ms, invariant {1000 * inv:.1f} ms: {inv / plain:.1f}x")


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
        for name, out in (("torch fp32", left @ b), ("invariant", invariant_matmul(left, b))):
            ulps = _ulps(out, reference.float())
            rel = ((out.double() - reference).abs() / bound).max()
            print(f"{label:>13}, K={args.dim}: {name:>10}: median {ulps.median():.0f} ulp, "
                  f"p99 {ulps.quantile(0.99):.0f} ulp, max error / bound {rel:.2e}")


def recipe(args) -> None:
    from samebits.recipes import RecipeConfig
    from samebits.recipes.loop import train

    times: dict[str, list[float]] = {"plain": [], "invariant": []}
    for _ in range(args.rounds):
        for name in times:
            result = train(RecipeConfig(ep=1, tp_reduce=name), steps=args.steps)
            times[name] += [m["step_time_s"] for m in result.metrics[3:]]
    plain, inv = (statistics.median(times[n]) for n in ("plain", "invariant"))
    print(f"recipe on one rank (defaults, ep=1), {args.steps} steps x {args.rounds}: plain "
          f"{1000 * plain:.1f} ms, tp_reduce=invariant {1000 * inv:.1f} ms a step: {inv / plain:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("layer")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=7)
    p = sub.add_parser("accuracy")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--out-dim", type=int, default=256)
    p = sub.add_parser("recipe")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    {"layer": layer, "accuracy": accuracy, "recipe": recipe}[args.command](args)


if __name__ == "__main__":
    main()
