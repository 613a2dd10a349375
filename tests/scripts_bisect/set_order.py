"""A user's script: gradient clipping over parameters gathered from a Python set.

The order of a set of strings changes with PYTHONHASHSEED (random per process unless set), so
the flattened gradient vector holds the same values in another order, and its norm (a
reduction) differs in its last bits from run to run.
"""

import torch

torch.set_num_threads(2)
torch.manual_seed(0)

model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64),
                            torch.nn.Tanh(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
params = dict(model.named_parameters())
clipped = set(params)  # every parameter, in hash order
data = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(32, 64, generator=data)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    flat = torch.cat([params[name].grad.flatten() for name in clipped])  # PLANTED: set order
    scale = 1.0 / (flat.norm() + 1e-6)
    for name in clipped:
        params[name].grad.mul_(scale)
    opt.step()
