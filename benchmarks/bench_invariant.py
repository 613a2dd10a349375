"""Invariant gradient reduction (samebits.invariant): accuracy, bytes on the wire, time.

    python benchmarks/bench_invariant.py accuracy [--elements 1048576] [--ranks 8]
    python benchmarks/bench_invariant.py comm [--nproc 2] [--elements 4194304] [--rounds 20] [--local-micro-batches 1]
    python benchmarks/bench_invariant.py loop [--nproc 2] [--steps 30]
    python benchmarks/bench_invariant.py recipe [--nproc 2] [--steps 12] [--rounds 5] [--cell dp2|fsdp2|tp2-dp2|pp2|ep2]

accuracy (one process): 8 "ranks" x 1M fp32 gradient elements of mixed scales (each block of
256 its own magnitude, 1e-6..1e2), summed (a) by the invariant reduction and (b) in fp32 in 24
random orders (a ring or tree at another size is another order).  Against a float64 reference
(the float64 sum rounded to fp32): share of elements equal to it, the largest difference in
fp32 ulps, and how many distinct results the orders give.  Then an adversarial set: blocks whose
elements span 9 decades (1e-7..1e2), where the encoding loses low bits of the smallest elements
(counted as inexact; the result is still the same at every DP size).

comm (torchrun, gloo): a flat fp32 gradient of --elements reduced over --nproc ranks by a plain
fp32 all-reduce and by `reduce_blocks` (int8 MAX exponents, int64 reduce-scatter, fp32
all-gather), side by side: each of --rounds rounds times both (alternating which goes first),
a round's time being its slowest rank's; the median of the per-round ratios with a 95% bootstrap
interval and the min-max, the median times, the 1-minute load average before and after (the
machine may be shared), and bytes per rank under the ring cost model (all-reduce 2(W-1)/W of
the buffer, reduce-scatter/all-gather (W-1)/W).  --local-micro-batches K: each rank reduces K
micro-batch gradients (the plain all-reduce still one buffer: plain training adds micro-batches
up in backward); with K <= 2 under gloo the fp32 rows travel to their owner, with more the int64
sums.

loop (torchrun): the small training loop of tests/scripts_invariant/train_dp.py, whole-step time
with --grad-reduce invariant versus mean, alternating runs; median step time ratio.

recipe (torchrun): the reference recipe (ep=1), 16 samples a step, side by side: each of
--rounds rounds runs every mode once (one torchrun each, the order rotating), and each ratio is
the median over rounds of the round's ratio of median step times (the recipe's own timer, the
first 3 steps of a run left out), with a 95% bootstrap interval, the min-max and the 1-minute
load average after each round.  Modes: "mean" (plain: one forward and backward of 8 samples a
DP rank), "invariant" as configured (grad_reduce=invariant, 4 micro-batches of 4: 2 forwards of
4 a rank at DP=2) and "invariant_same" (one micro-batch of 8 a rank, num_micro_batches = the DP
size: the same micro-batching as plain, so its ratio is the invariant reduction's and the keyed
draws' price alone).  --cell fsdp2 does the same under FSDP2 (`InvariantReduceScatter` versus
FSDP2's own reduce-scatter; as configured FSDP2 also all-gathers twice); --cell tp2-dp2 (4
ranks) adds tp_reduce=invariant to the invariant modes and runs "tp_only" (tp_reduce=invariant,
grad_reduce=mean), whose ratio to the invariant mode is the DP part's cost under TP; --cell pp2
runs the 16 samples as 4 pipeline micro-batches of 4 in both modes (1F1B: the same
micro-batching); --cell ep2 keeps the experts sharded (no ep=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from samebits.invariant import (DEFAULT_BLOCK_SIZE, ReduceStats, block_exponents, decode, encode, fraction_bits,
                                native_description, reduce_blocks)

HERE = Path(__file__).resolve().parent
TRAIN = HERE.parent / "tests" / "scripts_invariant" / "train_dp.py"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in fp32 ulps (ordered-integer distance of the bit patterns)."""
    def ordered(x):
        i = x.view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (ordered(a) - ordered(b)).abs()


def _invariant(parts: list[torch.Tensor], m: int) -> tuple[torch.Tensor, int]:
    bits = fraction_bits(m)
    exps = block_exponents(parts[0])
    for p in parts[1:]:
        exps = torch.maximum(exps, block_exponents(p))
    total, inexact = torch.zeros(parts[0].shape, dtype=torch.int64), 0
    for p in parts:
        q, lost = encode(p, exps, bits)
        total += q
        inexact += lost
    return decode(total, exps, bits), inexact


def accuracy(elements: int, ranks: int, orders: int = 24, spread_decades: float = 9.0) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks = elements // DEFAULT_BLOCK_SIZE
    out = {}
    for name, make in (("mixed scales", lambda: torch.logspace(-6, 2, blocks)[torch.randperm(blocks, generator=gen)][:, None]
                        * torch.ones(1, DEFAULT_BLOCK_SIZE)),
                       (f"{spread_decades:g}-decade blocks", lambda: torch.logspace(-7, 2, DEFAULT_BLOCK_SIZE)[
                           torch.randperm(DEFAULT_BLOCK_SIZE, generator=gen)][None, :] * torch.ones(blocks, 1))):
        scale = make()
        parts = [(torch.randn(blocks, DEFAULT_BLOCK_SIZE, generator=gen) * scale).float() for _ in range(ranks)]
        reference = torch.stack(parts).double().sum(0).float()  # float64 sum, rounded once to fp32
        inv, inexact = _invariant(parts, ranks)
        inv_again, _ = _invariant(parts[::-1], ranks)
        plain_results = set()
        worst_plain, share_plain = 0, []
        for _ in range(orders):
            order = torch.randperm(ranks, generator=gen).tolist()
            acc = parts[order[0]].clone()
            for i in order[1:]:
                acc += parts[i]
            plain_results.add(acc.view(torch.int32).numpy().tobytes())
            ulps = _ulps(acc, reference)
            worst_plain = max(worst_plain, int(ulps.max()))
            share_plain.append(float((ulps == 0).double().mean()))
        ulps = _ulps(inv, reference)
        out[name] = {
            "invariant_share_equal_to_f64_reference": float((ulps == 0).double().mean()),
            "invariant_max_ulp": int(ulps.max()),
            "invariant_inexact_elements": inexact,
            "invariant_same_in_reverse_order": bool(torch.equal(inv.view(torch.int32), inv_again.view(torch.int32))),
            "fp32_share_equal_to_f64_reference_mean": statistics.mean(share_plain),
            "fp32_max_ulp": worst_plain,
            "fp32_distinct_results_of_orders": f"{len(plain_results)} of {orders}",
        }
    return out


def _comm_worker(elements: int, rounds: int, local_micro_batches: int = 1) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    blocks = -(-elements // DEFAULT_BLOCK_SIZE)
    blocks = -(-blocks // world) * world
    grads = [(torch.randn(blocks, DEFAULT_BLOCK_SIZE, generator=gen) * 1e-3).float()
             for _ in range(local_micro_batches)]
    grad = grads[0]  # plain training adds micro-batches up in backward: it all-reduces one buffer
    plain, inv = [], []
    stats = ReduceStats()
    for r in range(rounds + 2):  # side by side: each round times both, in alternating order
        for mode in (("plain", "invariant") if r % 2 else ("invariant", "plain")):
            dist.barrier()
            t = time.perf_counter()
            if mode == "plain":
                flat = grad.reshape(-1).clone()
                dist.all_reduce(flat)
                plain.append(time.perf_counter() - t)
            else:
                reduce_blocks(grads, num_micro_batches=world * local_micro_batches, stats=stats if r == 0 else None)
                inv.append(time.perf_counter() - t)
    times = torch.tensor([plain[2:], inv[2:]], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a round lasts as long as its slowest rank
    if rank == 0:
        plain_s, inv_s = times[0].tolist(), times[1].tolist()
        ratios = [i / p for p, i in zip(plain_s, inv_s)]
        print(json.dumps({"nproc": world, "elements": blocks * DEFAULT_BLOCK_SIZE, "rounds": rounds,
                          "local_micro_batches": local_micro_batches,
                          "plain_allreduce_s": statistics.median(plain_s), "invariant_s": statistics.median(inv_s),
                          "time_ratio": statistics.median(ratios),
                          "time_ratio_95ci": _bootstrap_median_interval(ratios),
                          "time_ratio_min_max": [min(ratios), max(ratios)],
                          "bytes_per_rank_invariant": stats.bytes_sent,
                          "bytes_per_rank_fp32_allreduce": stats.fp32_allreduce_bytes,
                          "bytes_ratio": stats.bytes_sent / stats.fp32_allreduce_bytes}))
    dist.destroy_process_group()


def _bootstrap_median_interval(values: list[float], resamples: int = 2000) -> list[float]:
    """A 95% bootstrap interval of the median of ``values`` (resampled with replacement)."""
    gen = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(values), (resamples, len(values)), generator=gen)
    medians = torch.tensor(values, dtype=torch.float64)[picks].median(dim=1).values.sort().values
    return [float(medians[int(0.025 * resamples)]), float(medians[int(0.975 * resamples) - 1])]


def comm(nproc: int, elements: int, rounds: int, local_micro_batches: int = 1) -> dict:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            __file__, "_comm_worker", "--elements", str(elements), "--rounds", str(rounds),
            "--local-micro-batches", str(local_micro_batches)]
    load_before = os.getloadavg()[0]
    done = _run(argv)
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    return {**result, "native": native_description(), "load_1min_before_after": [load_before, os.getloadavg()[0]]}


def loop(nproc: int, steps: int, rounds: int) -> dict:
    times = {"invariant": [], "mean": []}
    for _ in range(rounds):
        for mode in times:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    str(TRAIN), "--steps", str(steps), "--grad-reduce", mode, "--num-micro-batches", "8",
                    "--micro-batch-size", "64", "--print-step-times"]
            done = _run(argv)
            line = [x for x in done.stdout.splitlines() if x.startswith("step_times ")][-1]
            times[mode] += json.loads(line.split(" ", 1)[1])[3:]
    inv, mean = statistics.median(times["invariant"]), statistics.median(times["mean"])
    return {"nproc": nproc, "steps": steps, "rounds": rounds, "invariant_step_s": inv, "mean_step_s": mean,
            "time_ratio": inv / mean}


def _recipe_modes(cell: str) -> dict[str, list[str]]:
    """The modes one round of ``recipe`` runs for ``cell``: each a list of ``--set`` overrides.

    The step is 16 samples in every mode.  "mean": plain (fp32 all-reduce, or FSDP2's own
    reduce-scatter), one forward and backward of 8 samples a DP rank.  "invariant": as the
    recipe is configured for invariance, 4 micro-batches of 4 (2 forwards of 4 a rank at DP=2;
    FSDP2 then all-gathers its parameters twice).  "invariant_same": the same micro-batching
    as plain, one micro-batch of 8 a rank (num_micro_batches = the DP size), so its ratio to
    "mean" is the price of the invariant reduction and keyed draws alone.
    """
    mean = ["--set", "micro_batch_size=8"]
    configured = ["--set", "grad_reduce=invariant", "--set", "num_micro_batches=4", "--set", "micro_batch_size=4"]
    same = ["--set", "grad_reduce=invariant", "--set", "num_micro_batches=2", "--set", "micro_batch_size=8"]
    if cell == "pp2":  # one DP rank: the 16 samples in 4 pipeline micro-batches of 4 either way
        return {"invariant": configured,
                "mean": ["--set", "micro_batch_size=16", "--set", "pp_microbatches=4"]}
    if cell == "tp2-dp2":  # "tp_only": the TP layers' price alone, so the DP part's shows apart
        tp = ["--set", "tp_reduce=invariant"]
        return {"invariant": [*configured, *tp], "invariant_same": [*same, *tp], "tp_only": [*mean, *tp],
                "mean": mean}
    return {"invariant": configured, "invariant_same": same, "mean": mean}


def recipe(nproc: int, steps: int, rounds: int, cell: str = "dp2", only: list[str] | None = None) -> dict:
    """Each round runs every mode once (one torchrun each, the order rotating from round to
    round); a round's ratio is the ratio of its runs' median step times (the recipe's own
    timer, the first 3 steps of each run left out).  The median of the rounds' ratios with a
    95% bootstrap interval and the min-max, so the load of a moment moves one round."""
    modes = _recipe_modes(cell)
    if only:  # "mean" always: every ratio is against it
        unknown = sorted(set(only) - set(modes))
        if unknown:
            raise SystemExit(f"--modes: {', '.join(unknown)} not among {', '.join(modes)} for {cell}")
        modes = {mode: argv for mode, argv in modes.items() if mode in only or mode == "mean"}
    layout: list[str] = []
    if cell != "dp2":
        nproc = {"fsdp2": 2, "tp2-dp2": 4, "pp2": 2, "ep2": 2}[cell]
        layout = ["--cell", cell]
    per_round: dict[str, list[float]] = {mode: [] for mode in modes}
    loads = [os.getloadavg()[0]]
    for r in range(rounds):
        order = list(modes)[r % len(modes):] + list(modes)[:r % len(modes)]
        for mode in order:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    "-m", "samebits.recipes", *layout, "--steps", str(steps),
                    *(["--set", "ep=1"] if cell != "ep2" else []), *modes[mode]]
            done = _run(argv)
            lines = [x for x in done.stdout.splitlines() if x.startswith("step ")]
            per_round[mode].append(statistics.median(
                float(x.rsplit("|", 1)[1].split()[0]) / 1000 for x in lines[3:]))
        loads.append(os.getloadavg()[0])
    result: dict = {"cell": cell, "nproc": nproc, "steps": steps, "rounds": rounds,
                    **{f"{mode}_step_s": statistics.median(values) for mode, values in per_round.items()}}
    baselines = {"invariant": "mean", "invariant_same": "mean", "tp_only": "mean"}
    if "tp_only" in modes:  # the DP part under TP: invariant over tp_reduce=invariant alone
        baselines["dp_part"] = "tp_only"
    for name, baseline in baselines.items():
        mode = "invariant" if name == "dp_part" else name
        if mode not in modes or baseline not in modes:
            continue
        ratios = [a / b for a, b in zip(per_round[mode], per_round[baseline])]
        result[f"{name}_ratio"] = statistics.median(ratios)
        result[f"{name}_ratio_95ci"] = _bootstrap_median_interval(ratios)
        result[f"{name}_ratio_min_max"] = [min(ratios), max(ratios)]
    result["load_1min_per_round"] = loads  # before the first round, then after each
    return result


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    """One training run; a failure stops the benchmark with the run's own error, not a bare exit code."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)}\nfailed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("accuracy", "comm", "loop", "recipe", "_comm_worker"))
    parser.add_argument("--elements", type=int, default=1 << 20)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="default: 20 (comm), 3 (loop), 5 (recipe)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cell", choices=("dp2", "fsdp2", "tp2-dp2", "pp2", "ep2"), default="dp2")
    parser.add_argument("--modes", default=None,
                        help="recipe: a comma-separated subset of the modes to run (e.g. invariant_same; "
                             "\"mean\", the baseline, always runs)")
    parser.add_argument("--local-micro-batches", type=int, default=1,
                        help="comm: micro-batch gradients each rank reduces (1-2: their fp32 rows go to their owner; "
                             "3 and more: int64 sums)")
    args = parser.parse_args()
    if args.what == "_comm_worker":
        _comm_worker(args.elements, args.rounds, args.local_micro_batches)
        return
    if args.rounds is None:
        args.rounds = {"recipe": 5, "loop": 3}.get(args.what, 20)
    torch.set_num_threads(1)
    if args.what == "accuracy":
        result = accuracy(args.elements, args.ranks)
    elif args.what == "comm":
        result = comm(args.nproc, args.elements, args.rounds, args.local_micro_batches)
    elif args.what == "recipe":
        result = recipe(args.nproc, args.steps, args.rounds, args.cell,
                        args.modes.split(",") if args.modes else None)
    else:
        result = loop(args.nproc, args.steps, args.rounds)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
