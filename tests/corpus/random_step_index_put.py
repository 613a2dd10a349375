"""Classifier with a centroid-pull penalty that the model adds every third step.

Planted fault: on those steps the `CentroidPull` submodule looks its centroids up with
advanced indexing, `self.centroids[label]`; the backward is index_put_ with accumulate=True,
which on CPU with 2 threads adds in thread arrival order.  Steps 0 and 1 are bitwise equal
run to run; step 2 is the first to differ.  Run: python random_step_index_put.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class CentroidPull(nn.Module):
    def __init__(self, classes=16, hidden=128):
        super().__init__()
        self.centroids = nn.Parameter(torch.zeros(classes, hidden))

    def forward(self, h, label):
        return (h - self.centroids[label]).square().mean()  # PLANTED


class Classifier(nn.Module):
    def __init__(self, dim=64, hidden=128, classes=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)
        self.pull = CentroidPull(classes, hidden)

    def forward(self, x, label, pull):
        h = self.body(x)
        loss = nn.functional.cross_entropy(self.head(h), label)
        return loss + 0.01 * self.pull(h, label) if pull else loss


model = Classifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(16384, 64, generator=data)
    label = torch.randint(0, 16, (16384,), generator=data)
    loss = model(x, label, pull=step % 3 == 2)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
