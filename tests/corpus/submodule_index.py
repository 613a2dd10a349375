"""Prototype classifier: each sample is compared with the prototype of its own class.

Planted fault: the prototypes are looked up with advanced indexing, `self.table[label]`,
inside the `Prototypes` submodule.  Its backward is index_put_ with accumulate=True, which on
CPU with 2 threads adds the many samples of one class in thread arrival order: the gradient
of the table differs run to run.  Run: python submodule_index.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class Prototypes(nn.Module):
    def __init__(self, classes=16, hidden=128):
        super().__init__()
        self.table = nn.Parameter(torch.randn(classes, hidden) * 0.1)

    def forward(self, label):
        return self.table[label]  # PLANTED (B, H): thousands of rows per class


class PrototypeNet(nn.Module):
    def __init__(self, dim=64, hidden=128):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden))
        self.prototypes = Prototypes(hidden=hidden)

    def forward(self, x, label):
        return (self.encoder(x) - self.prototypes(label)).square().mean()


model = PrototypeNet()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(16384, 64, generator=data)
    label = torch.randint(0, 16, (16384,), generator=data)
    loss = model(x, label)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
