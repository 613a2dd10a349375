"""Classifier with a histogram-balance penalty computed every third step.

Planted fault: the penalty bins the predictions with `index_put_(accumulate=True)`, whose CPU
kernel adds duplicated bins in thread arrival order with 2 threads; it runs only on steps 2,
5, ...  so runs agree at first and part at step 2.  Run: python random_step_index_put.py
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class BalancedClassifier(nn.Module):
    def __init__(self, dim=32, hidden=64, classes=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.body(x)


def balance_penalty(logits, bins):
    hist = logits.new_zeros(16, logits.shape[1])
    hist = hist.index_put((bins,), logits.softmax(-1), accumulate=True)  # PLANTED
    return hist.var()


model = BalancedClassifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    x = torch.randn(8192, 32, generator=data)
    y = torch.randint(0, 16, (8192,), generator=data)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits, y)
    if step % 3 == 2:
        loss = loss + 0.01 * balance_penalty(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
