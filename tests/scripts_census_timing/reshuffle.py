"""A user's script: each epoch re-shuffles its data with a private generator seeded from the
clock, made, drawn from and dropped while the next batch is fetched (before the step's first
forward): the shape of torchtitan's dataset ``reloop``."""

import time

import torch

torch.set_num_threads(1)
torch.manual_seed(0)

features = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
targets = torch.randn(16, 2, generator=torch.Generator().manual_seed(2))


def reshuffle() -> torch.Tensor:
    return torch.randperm(16, generator=torch.Generator().manual_seed(time.time_ns()))  # PLANTED: clock-seeded


def batches(epochs: int):
    order = torch.arange(16)
    for epoch in range(epochs):
        if epoch > 0:
            order = reshuffle()  # the generator is gone when this returns
        for start in range(0, 16, 8):
            index = order[start:start + 8]
            yield features[index], targets[index]


model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for x, y in batches(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
