"""A user's script: the data loader shuffles with a generator seeded from the clock."""

import time

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.set_num_threads(2)
torch.manual_seed(0)

features = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
targets = torch.randn(64, 2, generator=torch.Generator().manual_seed(2))
shuffle = torch.Generator().manual_seed(time.time_ns() % (2**31))  # PLANTED: seeded from the clock
loader = DataLoader(TensorDataset(features, targets), batch_size=8, shuffle=True, generator=shuffle)

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step, (x, y) in enumerate(loader):
    if step == 3:
        break
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
