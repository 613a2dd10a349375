"""A tiny character-level language model trained by Lightning from a shuffled DataLoader, with a
checkpoint every 4 training steps and `trainer.fit(..., ckpt_path=...)` to resume.

Planted fault: the checkpoint is written mid-epoch (6 batches an epoch) while the DataLoader
cannot resume mid-epoch: a resumed fit restores the model, optimizer, loop counters and (through
the module's checkpoint hooks) the RNG states, then restarts the epoch's batches from the first
one (Lightning warns and goes on), so step K trains on the epoch's first batch again.  A
checkpoint at the end of an epoch (every 6 steps) resumes exactly.
Needs `lightning`.
Run:    python lightning_mid_epoch.py --out DIR [--steps N]          # DIR/step=4.ckpt, step=8.ckpt
        python lightning_mid_epoch.py --out DIR --resume DIR_A/step=4.ckpt
"""
import argparse
import random

import lightning as L
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, CONTEXT = 64, 8


class CharModel(L.LightningModule):
    """Predicts the next character from the CONTEXT before it (embeddings, an MLP, dropout)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mlp = nn.Sequential(nn.Linear(16 * CONTEXT, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, VOCAB))

    def forward(self, context):
        return self.mlp(self.embed(context).flatten(1))

    def training_step(self, batch, batch_idx):
        context, target = batch
        loss = nn.functional.cross_entropy(self(context), target)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.01)

    # Lightning's checkpoints hold no RNG state: keep it with the model's, for the dropout masks
    # (plain lists and tuples: Lightning loads checkpoints with weights_only=True)
    def on_save_checkpoint(self, checkpoint):
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        checkpoint["rng"] = {"torch": torch.get_rng_state(), "numpy": (kind, keys.tolist(), pos, has_gauss, cached),
                             "python": random.getstate()}

    def on_load_checkpoint(self, checkpoint):
        torch.set_rng_state(checkpoint["rng"]["torch"])
        kind, keys, pos, has_gauss, cached = checkpoint["rng"]["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        random.setstate(checkpoint["rng"]["python"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="where the checkpoints go")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resume", default=None, help="a step=N.ckpt to resume from")
    args = parser.parse_args()
    torch.set_num_threads(2)
    L.seed_everything(0, verbose=False)

    # characters from a random Markov chain, made in memory: 48 (context, next character) pairs
    rng = np.random.default_rng(0)
    table = rng.dirichlet(np.full(VOCAB, 0.1), size=VOCAB).cumsum(axis=1)
    text, char = np.empty(48 + CONTEXT, dtype=np.int64), 0
    for i, u in enumerate(rng.random(len(text))):
        char = min(int(np.searchsorted(table[char], u)), VOCAB - 1)
        text[i] = char
    text = torch.from_numpy(text)
    contexts = torch.stack([text[i:i + CONTEXT] for i in range(48)])
    data = TensorDataset(contexts, text[CONTEXT:CONTEXT + 48])

    checkpoints = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.out, filename="{step}", save_top_k=-1, every_n_train_steps=4)  # PLANTED
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, callbacks=[checkpoints],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(CharModel(), DataLoader(data, batch_size=8, shuffle=True), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
