"""A tiny GPT-2 (2 layers, d=32) trained by the Hugging Face Trainer with checkpoint-N/ every 4
steps and `train(resume_from_checkpoint=...)`.

Planted fault: `ignore_data_skip=True` (set to make resuming start faster): the resumed Trainer
restores the model, optimizer, scheduler and RNG states but does not skip the batches of the
epoch already trained on, so step K trains on the epoch's first batch again.
Needs `transformers` and `accelerate`.
Run:    python hf_trainer_resume_skip.py --out DIR [--steps N]          # DIR/checkpoint-{4,8,...}
        python hf_trainer_resume_skip.py --out DIR --resume DIR_A/checkpoint-4
"""
import argparse

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoint-N/ go here)")
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
args = parser.parse_args()

torch.set_num_threads(2)

# 48 windows of 16 characters from a random Markov chain over 64 symbols, made in memory
rng = np.random.default_rng(0)
table = rng.dirichlet(np.full(64, 0.1), size=64).cumsum(axis=1)
text, char = np.empty(48 * 16, dtype=np.int64), 0
for i, u in enumerate(rng.random(len(text))):
    char = min(int(np.searchsorted(table[char], u)), 63)
    text[i] = char
windows = torch.from_numpy(text).view(48, 16)
dataset = [{"input_ids": row, "labels": row} for row in windows]

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, learning_rate=3e-3,
    lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, save_steps=4, seed=0, full_determinism=True,
    use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    ignore_data_skip=True,  # PLANTED
)
Trainer(model=model, args=training_args, train_dataset=dataset).train(resume_from_checkpoint=args.resume)
