"""A tiny GPT trained from a shuffled DataLoader with two worker processes; the Dataset crops
each window at a random offset.  A plain loop, LambdaLR cosine, a checkpoint every 4 steps.

Planted fault: the crop offset comes from `np.random.default_rng()` created without a seed in
`__getitem__`: fresh OS entropy in each worker, so the input batch differs every run from
the first step on, before the model runs (the seeds of torch, NumPy's global state and the
workers' base seed do not reach it).
Run:    python loader_workers_numpy_rng.py --out DIR [--steps N]            # DIR/step{0,4,...}.pt
        python loader_workers_numpy_rng.py --out DIR --resume DIR_A/step4.pt
"""
import argparse
import math
import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="the run's own folder: step{N}.pt every --ckpt-every steps")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--ckpt-every", type=int, default=4)
parser.add_argument("--resume", default=None, help="a step{N}.pt written by an earlier run")
args = parser.parse_args()

SEED, VOCAB, BLOCK, WIDTH, LAYERS, HEADS = 0, 64, 16, 32, 2, 2
torch.set_num_threads(2)
torch.manual_seed(SEED)
random.seed(SEED)
np.random.seed(SEED)


def synthetic_text(num_chars, seed):
    """Characters from a random Markov chain: structure a model can learn, made in memory."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(VOCAB, 0.1), size=VOCAB).cumsum(axis=1)
    text = np.empty(num_chars, dtype=np.uint8)
    char = 0
    for i, u in enumerate(rng.random(num_chars)):
        char = min(int(np.searchsorted(table[char], u)), VOCAB - 1)
        text[i] = char
    return text


class CharWindows(Dataset):
    """Windows of BLOCK + 1 characters (input and next-character target), each starting at a
    random offset inside its own stretch of text (a random crop, as an augmentation)."""

    def __init__(self, text):
        self.text = text

    def __len__(self):
        return (len(self.text) - 1) // (2 * BLOCK)

    def __getitem__(self, index):
        rng = np.random.default_rng()  # PLANTED
        start = 2 * BLOCK * index + int(rng.integers(0, BLOCK))
        chunk = torch.from_numpy(self.text[start:start + BLOCK + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.ff = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.drop = nn.Dropout(0.1)
        self.register_buffer("causal", torch.tril(torch.ones(BLOCK, BLOCK, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // HEADS)  # (B, heads, T, T)
        att = self.drop(att.masked_fill(~self.causal[:T, :T], float("-inf")).softmax(dim=-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.ff(self.norm2(x)))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.norm(self.blocks(x)))


def cosine_with_warmup(step, warmup=2, total=8):
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))


dataset = CharWindows(synthetic_text(48 * BLOCK + 1, seed=1))  # 24 windows: 6 batches an epoch
shuffle_gen = torch.Generator()
loader = DataLoader(dataset, batch_size=4, shuffle=True, drop_last=True, generator=shuffle_gen, num_workers=2)
model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup)

start = 0
if args.resume:
    ckpt = torch.load(args.resume, weights_only=False)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"]["torch"])  # dropout draws from the global generator
    random.setstate(ckpt["rng"]["python"])
    np.random.set_state(ckpt["rng"]["numpy"])
    start = ckpt["step"]


def epoch_batches(epoch, skip=0):
    """The batches of `epoch` from the `skip`-th on: the order depends on the epoch alone."""
    shuffle_gen.manual_seed(SEED + epoch)
    batches = iter(loader)
    for _ in range(skip):
        next(batches)
    return batches


os.makedirs(args.out, exist_ok=True)
epoch, seen = divmod(start, len(loader))
batches = epoch_batches(epoch, skip=seen)
for step in range(start, args.steps):
    if step % args.ckpt_every == 0:  # the state before this step: resuming from it runs this step next
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step,
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                            "numpy": np.random.get_state()}},
                   os.path.join(args.out, f"step{step}.pt"))
    try:
        x, y = next(batches)
    except StopIteration:  # a new epoch
        epoch += 1
        batches = epoch_batches(epoch)
        x, y = next(batches)
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    print(f"step {step} epoch {epoch} loss {loss.item():.4f} lr {scheduler.get_last_lr()[0]:.2e}")
