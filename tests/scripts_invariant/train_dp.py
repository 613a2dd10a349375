"""A small data-parallel training loop that is invariant to its DP size (docs/invariance.md).

    python tests/scripts_invariant/train_dp.py --steps 20 --out runs/dp1
    torchrun --nproc-per-node 2 tests/scripts_invariant/train_dp.py --steps 20 --out runs/dp2
    torchrun --nproc-per-node 4 tests/scripts_invariant/train_dp.py --steps 20 --out runs/dp4 --ckpt ck
    python tests/scripts_invariant/train_dp.py --resume-from ck --first-step 7 --steps 8 --out runs/replay
    ... --grad-reduce mean    the control: fp32 accumulation and all-reduce (depends on DP size)

A global batch of M micro-batches per step (micro-batch m of step s is a pure function of
(seed, s, m)); rank r takes micro-batches [r*M/W, (r+1)*M/W).  The model: three Linear layers
with dropout, whose masks come from torch's RNG keyed by (step, micro-batch).  Each
micro-batch's summed loss is divided by the global sample count (an exact integer
all-reduce).  `--grad-reduce invariant` reduces through `samebits.invariant`; `mean`
accumulates in fp32 and all-reduces in fp32, as usual.  Records metrics, reduced grads and
params at every step (rank 0's are replicated); `--ckpt DIR` saves the replicated state
before every step (DIR/step-K.pt), `--resume-from DIR --first-step K` starts from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import samebits
from samebits.invariant import (GradientAccumulator, InvariantHookState, clip_grad_norm_, invariant_comm_hook,
                                micro_batch_seed)

NUM_FEATURES, NUM_CLASSES = 24, 10


def build_model() -> nn.Module:
    torch.manual_seed(1234)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(NUM_FEATURES, 64), nn.GELU(), nn.Dropout(0.2),
                         nn.Linear(64, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, NUM_CLASSES))


def micro_batch(seed: int, step: int, index: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples of micro-batch ``index`` of ``step``: depends on nothing else."""
    gen = torch.Generator().manual_seed(micro_batch_seed(seed + 7, step, index))
    scale = torch.logspace(-2, 2, NUM_FEATURES)  # features of many magnitudes: rounding shows
    x = torch.randn(size, NUM_FEATURES, generator=gen) * scale
    y = torch.randint(0, NUM_CLASSES, (size,), generator=gen)
    return x, y


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="run steps [start, steps)")
    parser.add_argument("--first-step", type=int, default=0, help="first step (with --resume-from)")
    parser.add_argument("--num-micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--grad-reduce", choices=("invariant", "mean"), default="invariant")
    parser.add_argument("--ddp", action="store_true",
                        help="invariant mode through DDP and invariant_comm_hook instead of the accumulator")
    parser.add_argument("--rng-key", default="step_micro_batch", help="declared RNG keying (rank is refused)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--ckpt", type=Path, help="save the state before every step here")
    parser.add_argument("--resume-from", type=Path, help="a --ckpt folder; starts at --first-step")
    parser.add_argument("--print-step-times", action="store_true", help="rank 0 prints step times (benchmark)")
    args = parser.parse_args(argv)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(args)
    finally:
        torch.set_num_threads(threads)


def _train(args) -> int:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)
    if args.resume_from is not None:
        state = torch.load(args.resume_from / f"step-{args.first_step}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    try:
        acc = GradientAccumulator(model.named_parameters(), num_micro_batches=args.num_micro_batches,
                                  seed=args.seed, micro_batch_size=args.micro_batch_size, rng_key=args.rng_key)
    except samebits.ConfigError as err:
        print(f"train_dp: error: {err}", file=sys.stderr)
        return 2
    forward = model
    if args.ddp:
        if args.grad_reduce != "invariant" or world_size == 1:
            print("train_dp: error: --ddp needs --grad-reduce invariant and torchrun", file=sys.stderr)
            return 2
        forward = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)  # several buckets
        forward.register_comm_hook(InvariantHookState(num_micro_batches=args.num_micro_batches),
                                   invariant_comm_hook)
    config = {"grad_reduce": args.grad_reduce, "num_micro_batches": args.num_micro_batches,
              "micro_batch_size": args.micro_batch_size, "seed": args.seed}
    rec = samebits.Recorder(args.out, rank=rank, world_size=world_size, config=config) if args.out else None
    step_times = []
    for step in range(args.first_step, args.steps):
        started = time.perf_counter()
        if args.ckpt is not None and rank == 0:
            args.ckpt.mkdir(parents=True, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                       args.ckpt / f"step-{step}.pt")
        total = acc.global_count(args.micro_batch_size * len(acc.micro_batches()))
        loss_sum = torch.zeros(())
        for index in acc.micro_batches():
            x, y = micro_batch(args.seed, step, index, args.micro_batch_size)
            with acc.micro_batch(step, index):  # dropout keyed by (step, micro-batch)
                loss = nn.functional.cross_entropy(forward(x), y, reduction="sum") / total
                loss.backward()  # "mean": accumulates into p.grad in fp32
            loss_sum += loss.detach()
            if args.grad_reduce == "invariant" and not args.ddp:
                acc.accumulate()
        if args.grad_reduce == "invariant":
            if not args.ddp:  # with DDP the hook reduced during the last backward
                acc.reduce()
            grad_norm = clip_grad_norm_(model.parameters(), 1.0)
        else:
            for p in model.parameters():  # the usual: one fp32 all-reduce of the local sums
                if world_size > 1:
                    dist.all_reduce(p.grad)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        if rec is not None:
            rec.metrics(step, grad_norm=grad_norm)
            rec.tensors(step, "grads", [(n, p.grad) for n, p in model.named_parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - started)
        if rec is not None:
            rec.tensors(step, "params", [(n, p.detach()) for n, p in model.named_parameters()])
            rec.end_step(step)
    if rec is not None:
        rec.close()
    if args.print_step_times and rank == 0:
        print("step_times " + json.dumps(step_times), flush=True)
    if world_size > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written and closed. Skip the C++ static destructors: under load a gloo
    # process occasionally aborts there (SIGABRT, no Python frame), as the recipe documents.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
