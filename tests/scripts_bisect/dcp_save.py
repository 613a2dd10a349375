"""A one-rank gloo loop that saves a torch.distributed.checkpoint (DCP) after every step, as
torchtitan does: DCP's save broadcasts a fresh random save_id each time, so the checkpoint
save's own collectives differ between any two runs while training is bit-identical.

    python dcp_save.py --out DIR
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(args.steps):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    for p in model.parameters():  # the gradients averaged over the (one) rank, as data parallel does
        dist.all_reduce(p.grad)
    optimizer.step()
    dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
             checkpoint_id=os.path.join(args.out, f"step-{step + 1}"))
dist.destroy_process_group()
