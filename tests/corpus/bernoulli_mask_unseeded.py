"""Masked-feature regression: each step hides random input features (a BERT-style mask).

Planted fault: after initialisation the script re-seeds torch from `os.urandom` ("a fresh
seed per experiment"), so `torch.bernoulli` in the loop, which draws from the torch CPU
generator, picks other masks every run; the mask is drawn before the model runs.
Run: python bernoulli_mask_unseeded.py [--steps N]
"""
import argparse
import os

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # PLANTED
for step in range(args.steps):
    x = torch.randn(128, 32, generator=data)
    mask = torch.bernoulli(torch.full_like(x, 0.15))
    loss = nn.functional.mse_loss(model(x * (1 - mask)), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
