"""MLP with dropout; the weights are initialised from seed 0, then training is "re-seeded".

Planted fault: the training seed is taken from the clock, so the torch CPU generator (which
draws the dropout masks) holds another state at the first step of every run.
Run: python dropout_time_seed.py [--steps N]
"""
import argparse
import time

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.1), nn.Linear(128, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
torch.manual_seed(time.time_ns() % 2**31)  # PLANTED
for step in range(args.steps):
    x = torch.randn(64, 32, generator=data)
    y = torch.randint(0, 4, (64,), generator=data)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
