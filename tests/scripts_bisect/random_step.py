"""A user's script: the backward of `pooled[idx]` (index_put_ with accumulate) races with 2
threads, but at this size only on about half of the steps: the first step where two runs
differ changes from run to run."""

import torch

torch.set_num_threads(2)
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 256)
        self.head = torch.nn.Linear(256, 4)

    def forward(self, x, idx):
        pooled = torch.tanh(self.proj(x))  # (256, 256)
        return self.head(pooled[idx])  # PLANTED: backward is index_put_ accumulate


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.Generator().manual_seed(1)
for step in range(8):
    x = torch.randn(256, 32, generator=data)
    idx = torch.randint(0, 256, (256,), generator=data)
    target = torch.randn(256, 4, generator=data)
    loss = (model(x, idx) - target).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
