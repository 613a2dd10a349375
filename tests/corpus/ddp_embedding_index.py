"""Bag-of-tokens classifier under DistributedDataParallel, 2 ranks over gloo.

Planted fault: the token table is read with advanced indexing, `self.table[tokens]`, inside
the `TokenBag` submodule; its backward is index_put_ with accumulate=True, which on CPU with
2 threads adds repeated tokens in thread arrival order.  DDP then averages the differing
gradients.  Run: torchrun --standalone --nproc-per-node 2 ddp_embedding_index.py
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class TokenBag(nn.Module):
    def __init__(self, vocab=128, dim=64):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, dim) * 0.02)

    def forward(self, tokens):  # (B, T)
        return self.table[tokens].mean(1)  # PLANTED


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = TokenBag()
        self.head = nn.Linear(64, 8)

    def forward(self, tokens):
        return self.head(self.bag(tokens))


model = DistributedDataParallel(BagClassifier())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1 + rank)
for step in range(args.steps):
    tokens = torch.randint(0, 128, (64, 256), generator=data)
    label = torch.randint(0, 8, (64,), generator=data)
    loss = nn.functional.cross_entropy(model(tokens), label)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"rank {rank} step {step} loss {loss.item():.6f}")
dist.destroy_process_group()
