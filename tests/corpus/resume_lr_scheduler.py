"""Regression MLP with a warm-up/decay LR schedule, a checkpoint every step and --resume.

Planted fault: the checkpoint saves the model, the optimizer, the RNG and the step but not the
LR scheduler; a resumed run builds a fresh scheduler, so its learning rate restarts from the
warm-up value and the first optimizer step after the resume writes other parameters.
Run: python resume_lr_scheduler.py --ckpt DIR [--steps N] [--resume DIR/stepK.pt]
"""
import argparse
import os

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--resume", default=None, help="a checkpoint file written by --ckpt (stepK.pt)")
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.9 ** s)

start = 0
if args.resume is not None:
    state = torch.load(args.resume)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])  # PLANTED the scheduler's state is neither saved nor loaded
    torch.set_rng_state(state["rng"])
    start = state["step"]
os.makedirs(args.ckpt, exist_ok=True)
for step in range(start, args.steps):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                "step": step}, os.path.join(args.ckpt, f"step{step}.pt"))
    data = torch.Generator().manual_seed(1000 + step)  # batch `step`, wherever the run started
    x, y = torch.randn(64, 32, generator=data), torch.randn(64, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    print(f"step {step} loss {loss.item():.6f} lr {sched.get_last_lr()[0]:.6f}")
