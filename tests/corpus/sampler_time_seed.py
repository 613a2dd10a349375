"""Regression MLP trained from a shuffled DataLoader.

Planted fault: the sampler's generator is seeded from the clock and the process id, so each
run sees the samples in another order: the input batch differs from the first step, before
the model runs.  Run: python sampler_time_seed.py [--steps N]
"""
import argparse
import os
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)

data = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(1024, 32, generator=data), torch.randn(1024, 1, generator=data))
shuffle = torch.Generator().manual_seed(time.time_ns() ^ os.getpid())  # PLANTED
loader = DataLoader(dataset, batch_size=64, shuffle=True, generator=shuffle)

model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step, (x, y) in zip(range(args.steps), loader):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
