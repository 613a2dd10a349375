"""A user's nanoGPT-style train.py, tiny (2-layer GPT, d=32, a few iterations, 2 threads).

Written like nanoGPT's: its own `--init-from resume`, a `get_batch` on the global generator
that prefetches the first batch once before the loop, an eval pass every `--eval-interval`
iterations, `loss.item()` logging after the optimizer step, the iteration counter in the
checkpoint and the learning rate computed from it (warmup, then cosine decay).

`--save-at K --ckpt DIR` saves the checkpoint at the top of iteration K (model, optimizer,
iteration counter, the prefetched batch and the CPU generator's state); `--init-from resume
--ckpt DIR` resumes it and is then bitwise identical to the uninterrupted run, unless
`--fault` plants one of (`--optimizer sgd`: SGD with momentum, whose state has no step count):

* ``optimizer``    the resume does not restore the optimizer state;
* ``iter``         the resume does not restore the iteration counter (the LR schedule restarts);
* ``clip-set``     clip_grad_norm_ over the parameters gathered from a set of names;
* ``groups-set``   the optimizer's parameter groups built from a set of names.

(A set of strings is ordered by PYTHONHASHSEED, random per process.)  Each planted line is
marked ``# PLANTED: <fault>``.
"""

import argparse
import math
import os

import torch
import torch.nn as nn
from torch.nn import functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--init-from", default="scratch", choices=["scratch", "resume"])
parser.add_argument("--ckpt", default=None)
parser.add_argument("--save-at", type=int, default=None)
parser.add_argument("--max-iters", type=int, default=4)
parser.add_argument("--eval-interval", type=int, default=2)
parser.add_argument("--eval-iters", type=int, default=2)
parser.add_argument("--log-interval", type=int, default=1)  # 0: no logging
parser.add_argument("--grad-clip", type=float, default=0.05)
parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])  # sgd: momentum, no step count
parser.add_argument("--fault", default="none", choices=["none", "optimizer", "iter", "clip-set", "groups-set"])
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(1337)
block_size, batch_size, vocab_size = 16, 4, 64
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-3, 1e-4, 2, 8

# the "dataset": a fixed token stream
train_data = torch.randint(vocab_size, (2048,), generator=torch.Generator().manual_seed(0))
val_data = torch.randint(vocab_size, (512,), generator=torch.Generator().manual_seed(1))


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, n_layer=2, n_head=2, n_embd=32):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(0, idx.size(1), dtype=torch.long)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay, lr, betas):
        param_dict = {pn: p for pn, p in self.named_parameters()}
        if args.fault == "groups-set":
            decay_names = {pn for pn, p in param_dict.items() if p.dim() >= 2}  # PLANTED: groups-set
        else:
            decay_names = [pn for pn, p in param_dict.items() if p.dim() >= 2]
        decay_params = [param_dict[pn] for pn in decay_names]
        nodecay_params = [p for pn, p in param_dict.items() if p.dim() < 2]
        groups = [{"params": decay_params, "weight_decay": weight_decay},
                  {"params": nodecay_params, "weight_decay": 0.0}]
        if args.optimizer == "sgd":
            return torch.optim.SGD(groups, lr=lr, momentum=betas[0])
        return torch.optim.AdamW(groups, lr=lr, betas=betas)


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ("train", "val"):
        losses = torch.zeros(args.eval_iters)
        for k in range(args.eval_iters):
            X, Y = get_batch(split)
            _, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


iter_num = 0
model = GPT()
checkpoint = None
if args.init_from == "resume":
    checkpoint = torch.load(os.path.join(args.ckpt, "ckpt.pt"), weights_only=False)
    model.load_state_dict(checkpoint["model"])
    if args.fault != "iter":
        iter_num = checkpoint["iter_num"]  # (fault "iter": the counter restarts at 0)
optimizer = model.configure_optimizers(weight_decay=0.1, lr=learning_rate, betas=(0.9, 0.95))
X, Y = get_batch("train")  # fetch the very first batch
if checkpoint is not None:
    if args.fault != "optimizer":
        optimizer.load_state_dict(checkpoint["optimizer"])
    X, Y = checkpoint["batch"]  # the batch the saved run had prefetched, and its generator
    torch.set_rng_state(checkpoint["rng"])
    checkpoint = None
if args.fault == "clip-set":
    named = dict(model.named_parameters())
    clip_params = [named[pn] for pn in set(named)]  # PLANTED: clip-set
else:
    clip_params = list(model.parameters())

while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if args.save_at is not None and iter_num == args.save_at:
        os.makedirs(args.ckpt, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num,
                    "batch": (X, Y), "rng": torch.get_rng_state()}, os.path.join(args.ckpt, "ckpt.pt"))
    if iter_num % args.eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    logits, loss = model(X, Y)
    X, Y = get_batch("train")  # async prefetch of the next batch
    loss.backward()
    if args.grad_clip != 0.0:
        torch.nn.utils.clip_grad_norm_(clip_params, args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if args.log_interval and iter_num % args.log_interval == 0:
        lossf = loss.item()
        print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}")
    iter_num += 1
    if iter_num >= args.max_iters:
        break
