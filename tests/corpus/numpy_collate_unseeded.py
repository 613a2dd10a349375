"""Classifier whose collate function adds Gaussian noise to each batch (augmentation).

Planted fault: the noise comes from `np.random.default_rng()` without a seed, which draws
fresh OS entropy: the input batch differs every run, before the model runs.
Run: python numpy_collate_unseeded.py [--steps N]
"""
import argparse

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)

noise = np.random.default_rng()  # PLANTED


def collate(samples):
    x = torch.stack([s[0] for s in samples])
    y = torch.stack([s[1] for s in samples])
    return x + torch.from_numpy(noise.normal(0.0, 0.01, size=x.shape).astype(np.float32)), y


data = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(1024, 32, generator=data), torch.randint(0, 4, (1024,), generator=data))
loader = DataLoader(dataset, batch_size=64, collate_fn=collate)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
for step, (x, y) in zip(range(args.steps), loader):
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
