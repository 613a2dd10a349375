"""A user's script that checkpoints and resumes: `--save-at K --ckpt DIR` saves the model,
the optimizer and the CPU generator's state before step K; `--resume DIR` loads them and
runs steps K.. to the end.  PLANTED: the resume forgets torch.set_rng_state unless
`--restore-rng` is given, so the dropout masks from step K on differ from the uninterrupted run."""

import argparse
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--save-at", type=int, default=None)
parser.add_argument("--ckpt", default=None)
parser.add_argument("--resume", default=None)
parser.add_argument("--restore-rng", action="store_true")
args = parser.parse_args()

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.5), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
data = torch.Generator().manual_seed(1)
batches = [(torch.randn(4, 8, generator=data), torch.randn(4, 4, generator=data)) for _ in range(args.steps)]

start = 0
if args.resume:
    saved = torch.load(os.path.join(args.resume, "ckpt.pt"), weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    start = saved["step"]
    if args.restore_rng:
        torch.set_rng_state(saved["rng"])

for step in range(start, args.steps):
    if args.save_at is not None and step == args.save_at:
        os.makedirs(args.ckpt, exist_ok=True)
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                    "rng": torch.get_rng_state()}, os.path.join(args.ckpt, "ckpt.pt"))
    x, target = batches[step]
    loss = (model(x) - target).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
