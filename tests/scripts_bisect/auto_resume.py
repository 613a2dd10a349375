"""A trainer that resumes by itself from the latest checkpoint in its output folder, as
torchtitan and the Hugging Face Trainer (`resume_from_checkpoint=True`) do.

    python auto_resume.py --out DIR                       # trains; DIR/ckpt-K.pt before each step K
    python auto_resume.py --out DIR --init-from FILE      # a fresh folder, started from FILE

Run twice in one folder, the second run resumes at the end and trains nothing: a runner must
give each run a folder of its own.
"""

import argparse
import glob
import os

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--init-from", default=None)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
saved = sorted(glob.glob(os.path.join(args.out, "ckpt-*.pt")), key=lambda p: int(p.rsplit("-", 1)[1][:-3]))
source = saved[-1] if saved else args.init_from  # the latest checkpoint of this folder first
step = 0
if source:
    state = torch.load(source, weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    step = state["step"]
os.makedirs(args.out, exist_ok=True)
while step < args.steps:
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                "step": step}, os.path.join(args.out, f"ckpt-{step}.pt"))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
            "step": step}, os.path.join(args.out, f"ckpt-{step}.pt"))  # the last one: a later run here trains nothing
