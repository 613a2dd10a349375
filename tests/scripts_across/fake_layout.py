"""A fake training program for tests/test_across.py: one "layout" of `verify --across`.

It records one global parameter ``w`` and a metric per step; ``--values`` fixes them:
``same`` (every layout computes the same bits), ``from-step-2`` (the same until step 2, then
other bits), anything else (bits seeded by that word: another layout's rounding).  With
``--save-at K --ckpt DIR`` it also writes a checkpoint file of step K.
"""

import argparse
import zlib
from pathlib import Path

import torch

import samebits

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--values", required=True)
parser.add_argument("--name", required=True)
parser.add_argument("--save-at", type=int)
parser.add_argument("--ckpt")
args = parser.parse_args()

seed = 0 if args.values in ("same", "from-step-2") else zlib.crc32(args.values.encode())
with samebits.Recorder(args.out, rank=0, world_size=1, config={"name": args.name}) as rec:
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(seed * 1000 + step + (7 if args.values == "from-step-2" and step >= 2
                                                                        else 0))
        w = torch.randn(8, generator=generator)
        rec.metrics(step, loss=float(w.sum()))
        rec.global_tensors(step, "params", [("w", w)])
        rec.end_step(step)
        if args.save_at == step + 1 and args.ckpt:
            Path(args.ckpt).mkdir(parents=True, exist_ok=True)
            (Path(args.ckpt) / f"step-{args.save_at}.pt").write_bytes(w.numpy().tobytes())
