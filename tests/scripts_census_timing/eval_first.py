"""A user's loop shaped like litgpt's: each step evaluates first (no grad), then sets the LR
from its iteration counter and trains.  `--resume-from FILE` loads model and optimizer but
forgets the counter (`--restore-counter` restores it): the warm-up starts again at the resume."""

import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--save-at", type=int)
parser.add_argument("--ckpt")
parser.add_argument("--resume-from")
parser.add_argument("--restore-counter", action="store_true")
args = parser.parse_args()

torch.manual_seed(0)
data = torch.randn(8, 4, 3, generator=torch.Generator().manual_seed(1))
model = torch.nn.Linear(3, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
iteration = 0
if args.resume_from:
    checkpoint = torch.load(args.resume_from)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if args.restore_counter:
        iteration = checkpoint["iteration"]
while iteration < 8:
    with torch.no_grad():
        model(data[0])  # an evaluation before the step: the LR is not set yet
    for group in optimizer.param_groups:
        group["lr"] = 0.1 * min(1.0, (iteration + 1) / 6)  # warm-up from the counter
    loss = model(data[iteration]).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    iteration += 1
    if args.save_at == iteration:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration},
                   args.ckpt)
