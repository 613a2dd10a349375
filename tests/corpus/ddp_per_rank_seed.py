"""Data-parallel MLP on 2 ranks over gloo, gradients averaged by hand with all_reduce.

Planted fault: the script seeds torch with `seed + rank` *before* building the model, meaning
to vary only the data per rank; the replicas start from different weights and never agree
(the loop averages gradients, it never broadcasts weights).  Every run repeats the same bits,
so only a check across ranks sees it.
Run: torchrun --standalone --nproc-per-node 2 ddp_per_rank_seed.py [--steps N]
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

torch.set_num_threads(2)
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(args.seed + rank)  # PLANTED the weights below should be the same on every rank
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1 + rank)
for step in range(args.steps):
    x, y = torch.randn(32, 32, generator=data), torch.randn(32, 1, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world_size
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.6f}")
dist.destroy_process_group()
