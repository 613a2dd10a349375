"""A user's loop shaped like HF Trainer's: the model takes its batch by keyword
(``model(**batch)``), and the collator masks tokens with an unseeded NumPy generator."""

import numpy as np
import torch

torch.manual_seed(0)
mask_rng = np.random.default_rng()  # PLANTED: no seed


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids=None, labels=None):
        logits = self.head(self.embed(input_ids))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


ids = torch.randint(0, 16, (4, 4, 6), generator=torch.Generator().manual_seed(1))
model = Model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    masked = torch.from_numpy(mask_rng.random(ids[step].shape) < 0.3)
    batch = {"input_ids": ids[step].masked_fill(masked, 0), "labels": ids[step]}
    loss = model(**batch)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
