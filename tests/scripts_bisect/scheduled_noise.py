"""Test double for a nondeterminism that fires at a random step: the n-th run of this script
(counted in the file named by $RUN_COUNTER) scales one activation by a slightly different
factor at the step SCHEDULE[n] says (no step: an exact run)."""

import os
import sys

import torch

SCHEDULE = [int(s) if s != "-" else None for s in sys.argv[1].split(",")]
with open(os.environ["RUN_COUNTER"], "a+") as counter:
    counter.seek(0)
    run = len(counter.read())
    counter.write("x")
fire_at = SCHEDULE[run] if run < len(SCHEDULE) else None

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.out = torch.nn.Linear(16, 2)

    def forward(self, x, scale):
        hidden = torch.tanh(self.inp(x)) * scale  # PLANTED: fires at a random step
        return self.out(hidden)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1)
for step in range(4):
    x = torch.randn(4, 8, generator=data)
    loss = model(x, 1.0000001 if step == fire_at else 1.0).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
