"""A minimal GPT trainer in the shape of popular ones, with the common resume bugs behind --bug.

    python minigpt.py --out DIR                              # trains, checkpoints at --ckpt-at
    python minigpt.py --out DIR --resume-from DIR [--bug B]  # resumes DIR/ckpt.pt

Shapes: a get_batch() on the global generator, called once before the loop (prefetch) and
after each forward; the LR computed from iter_num (warmup + cosine) and set into each param
group at the top of the loop (or a LambdaLR with --sched); weight-decay groups; loss.item()
logged after the optimizer step.  --loader: a shuffled DataLoader instead of get_batch.

Bugs (resume): optim (optimizer state not loaded), iter (iter_num not restored), sched (the
LambdaLR not restored), reinit (a layer re-initialised after the load), prefetch (the batch
prefetched before the checkpoint drawn again), noskip (--loader: the batches already seen not
skipped), consumed (--loader: the RNG restored, then drawn from by the new iterator).
Bugs (every run): timeseed (a private generator seeded from the clock draws the batches).
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--resume-from", default=None)
parser.add_argument("--max-iters", type=int, default=6)
parser.add_argument("--ckpt-at", type=int, default=3)
parser.add_argument("--sched", action="store_true")
parser.add_argument("--loader", action="store_true")
parser.add_argument("--bug", default="")
args = parser.parse_args()
torch.set_num_threads(1)
torch.manual_seed(1337)
VOCAB, BLOCK, BATCH = 32, 8, 4
data = torch.randint(0, VOCAB, (2000,), generator=torch.Generator().manual_seed(0))
sampler = torch.Generator().manual_seed(int(time.time() * 1e6)) if args.bug == "timeseed" else None


def get_batch():
    ix = torch.randint(len(data) - BLOCK, (BATCH,), generator=sampler)
    return (torch.stack([data[i:i + BLOCK] for i in ix]), torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix]))


class Windows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return data[i * 16:i * 16 + BLOCK], data[i * 16 + 1:i * 16 + 1 + BLOCK]


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, idx, targets):
        logits = self.head(F.gelu(self.fc(self.wte(idx))))
        return logits, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


def get_lr(it):
    if it < 2:
        return 1e-2 * (it + 1) / 2
    return 1e-3 + 0.5 * (1 + math.cos(math.pi * it / args.max_iters)) * 9e-3


model = GPT()
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-2)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda it: get_lr(it) / 1e-2) if args.sched else None
loader = torch.utils.data.DataLoader(Windows(), batch_size=BATCH, shuffle=True) if args.loader else None
iter_num = 0
epoch_rng = torch.get_rng_state()  # --loader: the state the epoch's order is drawn from
if args.resume_from:
    ckpt = torch.load(os.path.join(args.resume_from, "ckpt.pt"), weights_only=False)
    model.load_state_dict(ckpt["model"])
    if args.bug != "optim":
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and args.bug != "sched":
        scheduler.load_state_dict(ckpt["scheduler"])
    if args.bug != "iter":
        iter_num = ckpt["iter_num"]
    if args.bug == "reinit":
        model.fc.reset_parameters()
    if loader is not None:
        if args.bug == "consumed":
            torch.set_rng_state(ckpt["rng"])
        else:
            torch.set_rng_state(ckpt["epoch_rng"])
        batches = iter(loader)
        for _ in range(0 if args.bug == "noskip" else ckpt["iter_num"]):
            next(batches)
        if args.bug != "consumed":
            torch.set_rng_state(ckpt["rng"])
    else:
        torch.set_rng_state(ckpt["rng"])
        X, Y = get_batch() if args.bug == "prefetch" else (ckpt["X"], ckpt["Y"])
elif loader is not None:
    batches = iter(loader)
else:
    X, Y = get_batch()
while iter_num < args.max_iters:
    if scheduler is None:
        for group in optimizer.param_groups:
            group["lr"] = get_lr(iter_num)
    if iter_num == args.ckpt_at and not args.resume_from:
        os.makedirs(args.out, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "rng": torch.get_rng_state(), "epoch_rng": epoch_rng,
                    "X": None if loader is not None else X, "Y": None if loader is not None else Y},
                   os.path.join(args.out, "ckpt.pt"))
    if loader is not None:
        X, Y = next(batches)
    logits, loss = model(X, Y)
    if loader is None:
        X, Y = get_batch()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    print(f"iter {iter_num}: loss {loss.item():.4f}")
    iter_num += 1
