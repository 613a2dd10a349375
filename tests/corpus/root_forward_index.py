"""Tiny retrieval classifier: encode a pool of items, gather the rows each query points at.

Planted fault: `pooled = items[query_item]` sits in the model's own top-level forward (not in
a submodule).  Its backward is index_put_ with accumulate=True, which on CPU with 2 threads
adds the duplicated rows in thread arrival order: the gradient of the encoder differs run to
run.  Run: python root_forward_index.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class Retriever(nn.Module):
    def __init__(self, dim=64, hidden=128, classes=10):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, classes)

    def forward(self, pool, query_item):
        items = self.encoder(pool)  # (P, H)
        pooled = items[query_item]  # PLANTED (Q, H): many queries hit the same item
        return self.head(pooled)


model = Retriever()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    pool = torch.randn(64, 64, generator=data)
    query_item = torch.randint(0, 64, (16384,), generator=data)
    target = torch.randint(0, 10, (16384,), generator=data)
    loss = nn.functional.cross_entropy(model(pool, query_item), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
