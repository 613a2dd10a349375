"""What real trainers do inside the process, with PyTorch's own APIs (no look-alikes): FSDP2
`fully_shard` on one gloo rank (DTensor parameters, gradients and optimizer state), selective
activation checkpointing (the recompute runs the blocks' forward again inside backward, under
SAC's dispatch mode) or full activation checkpointing, a container optimizer that subclasses
`Optimizer` and steps an inner one (as torchtitan's `OptimizersContainer` does: its one group has
no "lr"), and DCP's `_init_optim_state` (a zero-LR step that only creates the optimizer state, as
a checkpoint load makes).  Prints each step's loss bits and the final parameters' digest.

    python real_apis.py STEPS [--ac selective|full|none] [--no-fsdp] [--two]
"""

import argparse
import functools
import hashlib
import os
import struct

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import _init_optim_state
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int)
parser.add_argument("--ac", choices=("selective", "full", "none"), default="selective")
parser.add_argument("--no-fsdp", action="store_true")
parser.add_argument("--two", action="store_true", help="a second optimizer, stepped after the first (GAN-style)")
args = parser.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def _forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x):
        if args.ac == "none":
            return self._forward(x)
        if args.ac == "full":
            return checkpoint(self._forward, x, use_reentrant=False)

        def policy(ctx, op, *a, **k):  # save matmuls, recompute the rest (torchtitan's SAC shape)
            return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(self._forward, x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, policy))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(16) for _ in range(2))
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Container(torch.optim.Optimizer):
    """One object for the loop, inner optimizers doing the work (torchtitan's shape)."""

    def __init__(self, params):
        params = list(params)
        self.optimizers = [torch.optim.AdamW(params, lr=1e-2)]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure=None):
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none=True):
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


if not args.no_fsdp:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
model = Model()
if not args.no_fsdp:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
optimizer = Container(model.parameters())
for inner in optimizer.optimizers:
    _init_optim_state(inner)  # what a checkpoint load does before loading into the state
second = torch.optim.SGD([torch.nn.Parameter(torch.ones(4))], lr=0.1) if args.two else None
data = torch.randn(args.steps, 8, 16, generator=torch.Generator().manual_seed(1))
for step in range(args.steps):
    loss = model(data[step]).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if second is not None:
        (second.param_groups[0]["params"][0].sum() * loss.detach()).backward()
        second.step()
    print(f"step {step} loss {struct.unpack('<I', struct.pack('<f', loss.item()))[0]:08x}", flush=True)


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


final = hashlib.sha256(b"".join(full(p.detach()).numpy().tobytes() for p in model.parameters())).hexdigest()
print(f"final parameters {final}", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
