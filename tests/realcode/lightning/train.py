"""Train Lightning's own demo language model with `lightning.Trainer.fit`, checkpoint it, resume with `ckpt_path`.

The model and its training step are Lightning's (`lightning.pytorch.demos.LightningTransformer`: an
`nn.Transformer` with 2 encoder and 2 decoder layers, d=200, dropout 0.2, NLL loss), and so are the
loop, `ModelCheckpoint` (`OUT/ckpt/step=K.ckpt` every `--save-every` training steps) and the resume
(`trainer.fit(..., ckpt_path=...)`).  Lightning's demo data set (`WikiText2`) reads a text file it
would download; this launcher writes it first, from a seeded random Markov chain over 40 words, so
nothing is downloaded.  What a user chooses is here: the optimizer (the demo's plain SGD has no state
to restore; AdamW and a per-step LambdaLR do), a shuffled DataLoader of `--epoch-batches` batches of 4
sequences of 16 words, the seed and the callbacks.

Lightning's checkpoints hold no random state, so the dropout masks and the next epoch's shuffle of a
resumed run differ from the uninterrupted run's.  samebits' Lightning callback keeps the random states
in the checkpoint (docs/integrations.md); it is on unless `--no-rng-callback`.  With the defaults
(4 batches an epoch, a checkpoint every 4 steps: at an epoch's end) a resume is exact.

Run:    python train.py --out DIR                        # 8 steps; DIR/ckpt/step=4.ckpt, step=8.ckpt
        python train.py --out DIR --resume A/ckpt/step=4.ckpt
Check:  samebits verify --resume-at 4 --resume-with 'python train.py --out {out} --resume {from}/ckpt/step=4.ckpt' \\
            -- python train.py --out {out}
"""
import argparse
import os
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.pytorch.demos import LightningTransformer, WikiText2
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # faults.py beside this file
import faults  # noqa: E402

BLOCK, BATCH, WORDS_PER_LINE = 16, 4, 7  # a line is 7 words and "<eos>": 2 lines a sequence


class TransformerAdamW(LightningTransformer):
    """Lightning's demo model with AdamW and a learning rate that changes every step (the demo uses plain SGD)."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 0.25 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def write_corpus(path, num_sequences, seed=0):
    """WikiText2's text file, made up: a Markov chain over 40 words, enough lines for `num_sequences` samples."""
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(40)]
    table = rng.dirichlet(np.full(len(words), 0.2), size=len(words)).cumsum(axis=1)
    lines, word = [], 0
    for _ in range(2 * (num_sequences + 1)):  # WikiText2 has len(tokens) // BLOCK - 1 samples
        line = []
        for u in rng.random(WORDS_PER_LINE):
            word = min(int(np.searchsorted(table[word], u)), len(words) - 1)
            line.append(words[word])
        lines.append(" ".join(line))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="this run's folder: data/, ckpt/step=K.ckpt")
    parser.add_argument("--resume", default=None, help="a step=K.ckpt to resume from (trainer.fit's ckpt_path)")
    parser.add_argument("--steps", type=int, default=8, help="Trainer(max_steps=...)")
    parser.add_argument("--save-every", type=int, default=4, help="ModelCheckpoint(every_n_train_steps=...)")
    parser.add_argument("--epoch-batches", type=int, default=4, help="batches of 4 sequences in an epoch")
    parser.add_argument("--seed", type=int, default=0, help="lightning.seed_everything(seed)")
    parser.add_argument("--no-rng-callback", action="store_true",
                        help="leave out samebits' Lightning callback (Lightning's checkpoints then hold no random state)")
    parser.add_argument("--fault", choices=sorted(faults.FAULTS), default=None, help="apply a planted fault")
    args = parser.parse_args()
    if args.fault:
        faults.FAULTS[args.fault](args)
    torch.set_num_threads(2)
    L.seed_everything(args.seed, verbose=False)

    # the demo's prepare_data reads ./data/wikitext-2.txt (downloading it when absent): run in --out
    resume = os.path.abspath(args.resume) if args.resume else None
    os.makedirs(args.out, exist_ok=True)
    os.chdir(args.out)
    write_corpus(Path("data") / "wikitext-2.txt", num_sequences=args.epoch_batches * BATCH)
    dataset = WikiText2(data_dir=Path("data"), block_size=BLOCK, download=True)  # the file exists: no download
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)  # PLANTED (cannot resume mid-epoch: --epoch-batches 6)

    callbacks = [L.pytorch.callbacks.ModelCheckpoint(dirpath="ckpt", filename="{step}", save_top_k=-1,
                                                     every_n_train_steps=args.save_every)]
    if not args.no_rng_callback:  # PLANTED (--no-rng-callback: the checkpoint holds no random state)
        from samebits.integrations.lightning import SamebitsCallback

        callbacks.append(SamebitsCallback())
    trainer = L.Trainer(max_steps=args.steps, accelerator="cpu", devices=1, logger=False, callbacks=callbacks,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TransformerAdamW(vocab_size=dataset.vocab_size), loader, ckpt_path=resume)


if __name__ == "__main__":
    main()
