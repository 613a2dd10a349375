"""A `torch.compile`d model (dynamo, eager backend to keep it quick): samebits' global module
hooks must not break its graph (a graph break is another program: other kernels, other bits).
Prints each step's loss bits and dynamo's counts of graphs and graph breaks."""

import struct

import torch
import torch._dynamo.utils

torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)])
compiled = torch.compile(model, backend="eager")
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(8, 16)
for step in range(3):
    loss = compiled(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step} loss {struct.unpack('<I', struct.pack('<f', loss.item()))[0]:08x}", flush=True)
counters = torch._dynamo.utils.counters
print(f"step graphs {dict(counters['stats'])} breaks {sum(counters['graph_break'].values())}", flush=True)
