"""A user's script: weight-decay parameter groups built from Python sets.

A set of strings iterates in an order that changes with PYTHONHASHSEED (random per process
unless set), so the optimizer holds the same parameters in another order in each run.  SGD
updates each parameter on its own, so every value stays the same: only the order differs
(zero-code recording writes gradients, parameters and optimizer state in the optimizer's
parameter order).
"""

import torch

torch.set_num_threads(1)
torch.manual_seed(0)

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                            torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
params = dict(model.named_parameters())
decay = {name for name, p in params.items() if p.dim() >= 2}  # PLANTED: a set, in hash order
no_decay = {name for name, p in params.items() if p.dim() < 2}
opt = torch.optim.SGD([{"params": [params[n] for n in decay], "weight_decay": 0.1},
                       {"params": [params[n] for n in no_decay], "weight_decay": 0.0}], lr=0.1, momentum=0.9)
data = torch.Generator().manual_seed(1)
for step in range(3):
    x = torch.randn(32, 8, generator=data)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step}: loss {loss.item():.6f}")
