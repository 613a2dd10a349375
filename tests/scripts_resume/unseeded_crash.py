"""A user's trainer with two mistakes: the model is built without a seed, and its resume path
reads a checkpoint key the save never wrote.

    python unseeded_crash.py --out DIR                      # trains 4 steps, saves DIR/ckpt.pt at step 2
    python unseeded_crash.py --out DIR --resume-from DIR2   # crashes: KeyError 'optim'

Under `samebits verify` B differs from A at step 0 (the initial weights: the root cause of
anything after it) and C crashes: the error must keep the first finding.
"""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--resume-from", default=None)
args = parser.parse_args()
torch.set_num_threads(1)

model = torch.nn.Linear(8, 4)  # PLANTED: no torch.manual_seed before the model is built
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(0)
start = 0
if args.resume_from:
    ckpt = torch.load(os.path.join(args.resume_from, "ckpt.pt"))
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optim"])  # PLANTED: saved as "optimizer"
    start = ckpt["step"]
for step in range(start, 4):
    if step == 2 and not args.resume_from:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   os.path.join(args.out, "ckpt.pt"))
    loss = model(torch.randn(16, 8, generator=data)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f}")
