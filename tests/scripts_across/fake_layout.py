"""A fake training program for tests/test_across.py: one "layout" of `verify --across`.

It trains one global parameter ``w`` (each step adds a draw to it) and records it and a
metric per step; ``--values`` fixes the draws: ``same`` (every layout computes the same
bits), ``from-step-2`` (the same until step 2, then other bits), anything else (bits seeded
by that word: another layout's rounding).  With ``--save-at K[,K...] --ckpt DIR`` it saves a
samebits checkpoint before each step K (``--save-at 4`` with 4 steps: after the last);
``--resume-from DIR`` continues such a checkpoint (of any "layout": one process saves it),
``--perturb-resume`` flipping one bit of ``w`` on the way (a resume that is not exact), and
``--refuse-resume`` refusing it as the recipe refuses a switch missing (exit 2);
``--samples-per-step N`` (default 8) sets the data position it saves.
"""

import argparse
import random
import sys
import zlib

import numpy as np
import torch
from torch import nn

import samebits
from samebits import checkpoint


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--values", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--save-at")
    parser.add_argument("--ckpt")
    parser.add_argument("--resume-from")
    parser.add_argument("--perturb-resume", action="store_true")
    parser.add_argument("--refuse-resume", action="store_true")
    parser.add_argument("--samples-per-step", type=int, default=8)
    args = parser.parse_args()

    if args.refuse_resume and args.resume_from:
        print("samebits.recipes: error (rank 0): the checkpoint was saved at another data-parallel size; the "
              "gradient reduction depends on it: train and resume with --set grad_reduce=invariant", file=sys.stderr)
        sys.exit(2)

    # Every "layout" seeds the global random states alike, as a real program does: the saved
    # checkpoints' resumable-state hash covers them (an unseeded process holds its own).
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    seed = 0 if args.values in ("same", "from-step-2") else zlib.crc32(args.values.encode())
    saves = {int(k) for k in args.save_at.split(",")} if args.save_at else set()
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(8))
    start = 0
    if args.resume_from:
        bundle = checkpoint.StateBundle(model=model)
        checkpoint.load(args.resume_from, bundle)
        start = bundle.progress["step"]
        if args.perturb_resume:
            with torch.no_grad():
                model.w.view(torch.int32)[3] ^= 1

    def save(step: int) -> None:
        if step in saves and args.ckpt:
            progress = {"step": step, "consumed_samples": args.samples_per_step * step}
            checkpoint.save(args.ckpt, checkpoint.StateBundle(model=model, progress=progress))

    with samebits.Recorder(args.out, rank=0, world_size=1, config={"name": args.name}) as rec:
        for step in range(start, args.steps):
            save(step)
            shift = 7 if args.values == "from-step-2" and step >= 2 else 0
            generator = torch.Generator().manual_seed(seed * 1000 + step + shift)
            with torch.no_grad():
                model.w += torch.randn(8, generator=generator)
            w = model.w.detach()
            rec.metrics(step, loss=float(w.sum()))
            rec.global_tensors(step, "params", [("w", w)])
            rec.end_step(step)
        save(args.steps)


if __name__ == "__main__":
    main()
