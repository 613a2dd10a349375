"""A forward before the training loop first iterates its torchdata StatefulDataLoader (an
initial loss on a fixed batch): the census at that forward must not make the loader's iterator
(``state_dict()`` on a loader without one makes it, drawing the epoch's shuffle from torch's
generator), which would change the data order and every parameter after it."""

import torch
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

torch.manual_seed(0)
data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = StatefulDataLoader(data, batch_size=2, shuffle=True)
print("initial loss", torch.nn.functional.mse_loss(model(data[:4][0]), data[:4][1]).item())
torch.rand(1)  # the program draws before its loop: the shuffle's seed comes after
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("final", [v.view(torch.int32).tolist() for v in model.state_dict().values()])
