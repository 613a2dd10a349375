"""Regression MLP with a checkpoint after every step and a --resume option.

Planted fault: the checkpoint keeps the model, the optimizer and the RNG states but not the
data position; a resumed run restarts its data iterator from the first batch, so from the
resume step on it trains on other batches.
Run: python resume_data_position.py --ckpt DIR [--steps N] [--resume DIR/stepK.pt]
"""
import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--ckpt", required=True)
parser.add_argument("--resume", default=None, help="a checkpoint file written by --ckpt (stepK.pt)")
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)
data = torch.Generator().manual_seed(1)
dataset = TensorDataset(torch.randn(1024, 32, generator=data), torch.randn(1024, 1, generator=data))
loader = DataLoader(dataset, batch_size=64, shuffle=False)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

start = 0
if args.resume is not None:
    state = torch.load(args.resume)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["rng"])
    start = state["step"]
batches = iter(loader)  # PLANTED restarts at batch 0 instead of skipping `start` batches
os.makedirs(args.ckpt, exist_ok=True)
for step in range(start, args.steps):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                "step": step}, os.path.join(args.ckpt, f"step{step}.pt"))
    x, y = next(batches)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
