"""A tiny GPT-2 (2 layers, d=64) trained for a few steps with the Hugging Face Trainer.

Planted fault: the data collator masks random tokens with `np.random.default_rng()` created
without a seed; `TrainingArguments(seed=...)` seeds Python, NumPy's global state and torch,
but not this generator, so the input batch differs every run, before the model runs.
Needs `transformers` and `accelerate`.  Run: python hf_trainer_collator.py --out DIR
"""
import argparse

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--out", required=True)
args = parser.parse_args()

torch.set_num_threads(2)


class RandomTokens(Dataset):
    def __init__(self, n=256, length=32, vocab=256):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


mask_rng = np.random.default_rng()  # PLANTED


def collate(samples):
    ids = torch.stack([s["input_ids"] for s in samples])
    masked = torch.from_numpy(mask_rng.random(ids.shape) < 0.1)
    return {"input_ids": ids.masked_fill(masked, 0), "labels": ids}


config = GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
training_args = TrainingArguments(output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=8,
                                  learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], save_strategy="no",
                                  logging_steps=1, dataloader_num_workers=0, disable_tqdm=True)
torch.manual_seed(0)
trainer = Trainer(model=GPT2LMHeadModel(config), args=training_args, train_dataset=RandomTokens(),
                  data_collator=collate)
trainer.train()
