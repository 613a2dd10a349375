"""Regression MLP on a dataset that jitters each sample (a light augmentation).

Planted fault: the jitter comes from Python's `random` module, which nobody seeds (it seeds
itself from the OS at import): every run gets other inputs, before the model runs.
Run: python dataset_unseeded_random.py [--steps N]
"""
import argparse
import random

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class JitteredPoints(Dataset):
    def __init__(self, n=1024, dim=32):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, dim, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        scale = 1.0 + random.uniform(-0.05, 0.05)  # PLANTED
        return self.x[i] * scale, self.y[i]


loader = DataLoader(JitteredPoints(), batch_size=64, shuffle=False)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step, (x, y) in zip(range(args.steps), loader):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
