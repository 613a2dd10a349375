"""MLP with an L2-style penalty on a flat view of the weights it decays.

Planted fault: the decayed parameter names are collected in a Python `set`; iterating it
follows string hashing, which changes with PYTHONHASHSEED (random per process), so the
concatenated vector holds the same values in another order, and the weighted penalty differs.
Run: python set_param_order.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)

model = nn.Sequential(nn.Linear(32, 64), *[m for _ in range(6) for m in (nn.Tanh(), nn.Linear(64, 64))],
                      nn.Tanh(), nn.Linear(64, 4))
decayed = {name for name, p in model.named_parameters() if name.endswith("weight")}
params = dict(model.named_parameters())
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(128, 32, generator=data)
    y = torch.randn(128, 4, generator=data)
    flat = torch.cat([params[name].flatten() for name in decayed])  # PLANTED
    ramp = torch.linspace(1.0, 2.0, flat.numel())  # position-weighted penalty
    loss = nn.functional.mse_loss(model(x), y) + 1e-4 * (ramp * flat.square()).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
