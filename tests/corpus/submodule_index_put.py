"""Segment-pooling classifier: sum token features into their segment's slot, then classify.

Planted fault: the pooling submodule sums with `index_put_(..., accumulate=True)`; on CPU with
2 threads the duplicated slots are added in thread arrival order, so the forward output
differs run to run.  Run: python submodule_index_put.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class SegmentSum(nn.Module):
    def forward(self, tokens, segment, num_segments):
        out = tokens.new_zeros(num_segments, tokens.shape[1])
        return out.index_put_((segment,), tokens, accumulate=True)  # PLANTED


class Classifier(nn.Module):
    def __init__(self, dim=64, hidden=128, classes=10):
        super().__init__()
        self.embed = nn.Linear(dim, hidden)
        self.pool = SegmentSum()
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens, segment):
        return self.head(self.pool(self.embed(tokens), segment, 64))


model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    tokens = torch.randn(8192, 64, generator=data)
    segment = torch.randint(0, 64, (8192,), generator=data)
    target = torch.randint(0, 10, (64,), generator=data)
    loss = nn.functional.cross_entropy(model(tokens, segment), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
