"""Token classifier that drops a random quarter of the tokens in forward (token dropping).

Planted fault: after building the model the script calls `torch.seed()`, believing it seeds
torch; it re-seeds the CPU generator from OS entropy, so `torch.randperm` in forward picks
other tokens every run.  Run: python randperm_torch_seed.py [--steps N]
"""
import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)


class TokenDropClassifier(nn.Module):
    def __init__(self, dim=32, hidden=64, classes=4):
        super().__init__()
        self.embed = nn.Linear(dim, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens):  # tokens: (T, dim)
        keep = torch.randperm(tokens.shape[0])[: tokens.shape[0] * 3 // 4]
        return self.head(self.embed(tokens[keep]).mean(0, keepdim=True))


model = TokenDropClassifier()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
torch.seed()  # PLANTED
data = torch.Generator().manual_seed(1)
for step in range(args.steps):
    tokens = torch.randn(256, 32, generator=data)
    label = torch.randint(0, 4, (1,), generator=data)
    loss = nn.functional.cross_entropy(model(tokens), label)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.6f}")
