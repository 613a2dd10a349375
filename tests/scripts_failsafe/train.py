"""A small training loop with every kind of state samebits hooks: modules, backward, an
optimizer, an LR scheduler, a disabled GradScaler (as nanoGPT makes on CPU), a DataLoader,
a private generator.  It prints each step's loss bits and, at the end, a digest of its final
parameters: what must not change when samebits records it, fails inside it or not."""

import hashlib
import struct
import sys

import torch

torch.manual_seed(0)
torch.set_num_threads(1)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
data = torch.utils.data.TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
scaler = torch.amp.GradScaler("cpu", enabled=False)
step = 0
while step < steps:
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        print(f"step {step} loss {struct.unpack('<I', struct.pack('<f', loss.item()))[0]:08x}", flush=True)
        step += 1
        if step == steps:
            break
final = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"final parameters {final}", flush=True)
