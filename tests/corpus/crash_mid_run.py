"""Regression MLP whose data file runs out before the planned number of steps.

Planted fault: the loop indexes a fixed list of 3 batches for 6 steps; the run crashes at
step 3 with an IndexError after three clean optimizer steps.  A tool must report a failed
run, never PASS or IDENTICAL.  Run: python crash_mid_run.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)
data = torch.Generator().manual_seed(1)
batches = [(torch.randn(64, 32, generator=data), torch.randn(64, 1, generator=data)) for _ in range(3)]
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(args.steps):
    x, y = batches[step]  # PLANTED IndexError at step 3
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
