"""A loop over a fixed list of batches whose position is its own step counter (no DataLoader),
with the resume bugs of issue 33 behind --bug.

    python steps_and_batches.py --out DIR                                 # saves DIR/step-K.pt before each step K
    python steps_and_batches.py --out DIR --resume DIR/step-K.pt [--bug B]

Like torchtitan it saves model, optimizer and step but no random state, and every other step
it logs rows it picks from the global torch generator, after the optimizer step:
a resumed run's torch generator is in another state than A's, and no training step draws
from it.

Bugs (resume): counter (the step counter not restored: C trains its whole length again from
the resume step, past A's end), replay (the data position not restored: C's batches start
again from the first).  Bugs (every run): unseeded (the model is built before any seed).
"""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--resume", default=None)
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--bug", default="")
args = parser.parse_args()
os.makedirs(args.out, exist_ok=True)
torch.set_num_threads(1)
if args.bug != "unseeded":
    torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2 * args.steps)]
step = 0
position = 0  # the next batch
if args.resume:
    checkpoint = torch.load(args.resume, weights_only=True)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if args.bug != "counter":
        step = checkpoint["step"]
    if args.bug != "replay":
        position = checkpoint["position"]
while step < args.steps:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "position": position},
               f"{args.out}/step-{step}.pt")
    x = batches[position]
    position += 1
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    if step % 2 == 0:  # a log line showing rows picked from the global generator, after the step
        rows = torch.randint(0, len(batches), (2,)).tolist()
        print(f"step {step}: loss {loss.item():.5f}, sample rows {rows}")
