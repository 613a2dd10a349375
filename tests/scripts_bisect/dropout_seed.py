"""A user's script: the model is initialised from a fixed seed, then the global generator is
reseeded from the clock before training, so dropout draws other masks in every run."""

import time

import torch

torch.set_num_threads(2)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
torch.manual_seed(time.time_ns() % (2**31))  # PLANTED: reseeded from the clock
data = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(8, 16, generator=data)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
