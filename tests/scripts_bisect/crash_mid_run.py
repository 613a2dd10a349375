"""A user's script that crashes at step 2 (after two optimizer steps were recorded)."""

import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    if step == 2:
        raise RuntimeError("out of data")  # PLANTED: a crash mid-run
    loss = model(torch.ones(4, 8)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
