"""A tiny character-level GPT trained the nanoGPT way (train.py, bias=False), resumed from ckpt.pt.

Planted fault: the no-decay parameter group lists the layernorm weights by iterating a Python set
of their names, whose order follows PYTHONHASHSEED (random per process).  A run is
unaffected (the group holds the same parameters; AdamW updates each on its own), but the
optimizer's state_dict identifies parameters by their position in the groups: a resumed
process, with another hash seed, loads A's moments into other layernorm weights (all of
one shape, so nothing complains) and its first update after the resume differs.
Run:    python gpt_set_param_groups.py --out DIR [--max-iters N] [--ckpt-at K]   # DIR/ckpt.pt at K
        python gpt_set_param_groups.py --out DIR --resume-from DIR_A              # init_from = 'resume'
"""
import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="the run's own folder (ckpt.pt goes here)")
parser.add_argument("--resume-from", default=None, help="a folder holding ckpt.pt: init_from = 'resume'")
parser.add_argument("--max-iters", type=int, default=8)
parser.add_argument("--ckpt-at", type=int, default=None, help="write ckpt.pt at the top of this iteration")
args = parser.parse_args()
init_from = "resume" if args.resume_from else "scratch"

# -----------------------------------------------------------------------------
# config: a 2-layer GPT on 2 CPU threads, small enough for a few seconds a run
batch_size = 4
block_size = 16
vocab_size = 64
n_layer, n_head, n_embd = 2, 2, 32
dropout = 0.1
bias = False  # no biases in Linears and LayerNorms: a bit better and faster
gradient_accumulation_steps = 2
learning_rate = 1e-3
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
warmup_iters = 2
lr_decay_iters = 8
min_lr = 1e-4
eval_interval = 4
eval_iters = 2
seed = 1337
# -----------------------------------------------------------------------------

torch.set_num_threads(2)
torch.manual_seed(seed)
random.seed(seed)
np.random.seed(seed)

# the "dataset": a character stream from a random Markov chain, made in memory (no files)
data_rng = np.random.default_rng(0)
next_char = data_rng.dirichlet(np.full(vocab_size, 0.1), size=vocab_size).cumsum(axis=1)
stream = np.empty(8192, dtype=np.uint8)
char = 0
for i, u in enumerate(data_rng.random(len(stream))):
    char = min(int(np.searchsorted(next_char[char], u)), vocab_size - 1)
    stream[i] = char
split_at = int(0.9 * len(stream))
train_data, val_data = stream[:split_at], stream[split_at:]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block() for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd, bias=bias),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # scaled init of the residual projections (GPT-2)
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # every 2D tensor (matmul weights, embeddings) decays; the layernorm weights do not
        no_decay = {pn for pn, p in param_dict.items() if p.dim() < 2}
        decay_params = [p for pn, p in param_dict.items() if pn not in no_decay]
        nodecay_params = [param_dict[pn] for pn in no_decay]  # PLANTED
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:  # linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # cosine from 1 to 0
    return min_lr + coeff * (learning_rate - min_lr)


iter_num = 0
best_val_loss = 1e9
model = GPT()
if init_from == "resume":
    print(f"resuming training from {args.resume_from}")
    checkpoint = torch.load(os.path.join(args.resume_from, "ckpt.pt"), weights_only=False)
    model.load_state_dict(checkpoint["model"])
    iter_num = checkpoint["iter_num"]
    best_val_loss = checkpoint["best_val_loss"]
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2))
if init_from == "resume":
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["rng"]["torch"])
    random.setstate(checkpoint["rng"]["python"])
    np.random.set_state(checkpoint["rng"]["numpy"])
    checkpoint = None  # free up memory

os.makedirs(args.out, exist_ok=True)
# The torch RNG state just before each training batch is drawn: the checkpoint saves it, so
# that a resumed process draws the prefetched batch of its first iteration again.
rng_before_batch = torch.get_rng_state()
X, Y = get_batch("train")  # fetch the very first batch
t0 = time.time()
while True:
    # the learning rate of this iteration, from the iteration counter
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr

    if iter_num == args.ckpt_at:
        checkpoint = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "rng": {"torch": rng_before_batch, "python": random.getstate(), "numpy": np.random.get_state()},
        }
        print(f"saving checkpoint to {args.out}")
        torch.save(checkpoint, os.path.join(args.out, "ckpt.pt"))

    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        best_val_loss = min(best_val_loss, losses["val"])

    # forward backward update, with gradient accumulation
    for micro_step in range(gradient_accumulation_steps):
        logits, loss = model(X, Y)
        loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
        rng_before_batch = torch.get_rng_state()
        X, Y = get_batch("train")  # prefetch the next batch while the backward runs
        loss.backward()
    if grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    lossf = loss.item() * gradient_accumulation_steps  # a CPU-GPU sync point on a GPU
    print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, time {dt * 1000:.0f}ms")
    iter_num += 1
    if iter_num >= args.max_iters:
        break
