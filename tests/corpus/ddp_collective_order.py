"""Data-parallel MLP on 2 ranks over gloo with hand-made gradient buckets.

Planted fault: the buckets are reduced in the iteration order of a Python `set` of their
names, which follows PYTHONHASHSEED (random per process): the two ranks issue their
all_reduces in different orders and sum one rank's bucket with another bucket of the other
rank.  The buckets have the same size, so nothing fails; the weights are wrong, differently
every run.  Run: torchrun --standalone --nproc-per-node 2 ddp_collective_order.py
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(8)])
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
data = torch.Generator().manual_seed(1 + rank)
for step in range(args.steps):
    x, y = torch.randn(32, 64, generator=data), torch.randn(32, 64, generator=data)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    buckets = {f"bucket{i}": p.grad for i, p in enumerate(model.parameters())}
    works = [dist.all_reduce(buckets[name], async_op=True) for name in set(buckets)]  # PLANTED
    for work in works:
        work.wait()
    for p in model.parameters():
        p.grad /= world_size
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.6f}")
dist.destroy_process_group()
