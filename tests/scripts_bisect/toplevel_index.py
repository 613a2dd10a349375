"""A user's script: the model's own forward picks rows with advanced indexing.

`pooled[idx]` runs in the top-level module's forward, not in a submodule; its backward is
`index_put_` with accumulate=True, which adds in thread arrival order with 2 threads on CPU.
"""

import torch

torch.set_num_threads(2)
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 128)
        self.head = torch.nn.Linear(128, 4)

    def forward(self, x, idx):
        pooled = torch.tanh(self.proj(x))  # (rows, 128)
        picked = pooled[idx]  # PLANTED: backward is index_put_ accumulate
        return self.head(picked)


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(64, 32, generator=data)
    idx = torch.randint(0, 64, (16384,), generator=data)
    target = torch.randn(16384, 4, generator=data)
    loss = (model(x, idx) - target).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
