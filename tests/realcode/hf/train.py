"""Launcher for the Hugging Face Trainer (transformers 4.57.1): a tiny GPT-2 built from its config
object, a tokenizer-free synthetic token dataset, and `Trainer.train(resume_from_checkpoint=...)`.

Only this file's few lines are ours; the training loop, checkpointing and resume are the
Trainer's own, run as installed.  The fault wrappers (fault_*.py) import `main` and change one
thing from outside (a TrainingArguments knob, a data collator, one patched method, a hook).

Run:    python train.py --out DIR [--steps 8]                        # DIR/checkpoint-4, checkpoint-8
        python train.py --out DIR --resume DIR_A/checkpoint-4           # resume A's step-4 checkpoint
"""
import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the Trainer's output_dir (checkpoint-N/ go here)")
    parser.add_argument("--steps", type=int, default=8, help="max_steps")
    parser.add_argument("--resume", default=None, help="a checkpoint-N folder to resume from")
    return parser.parse_args()


def token_dataset(num_windows=384, length=32, vocab=64):
    """Random token windows from a private seeded generator: no tokenizer, no files."""
    ids = torch.randint(0, vocab, (num_windows, length), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in ids]


def main(training_args=None, data_collator=None, model_hook=None):
    """Train; `training_args` overrides TrainingArguments fields, `model_hook(model)` may change the
    model from outside before the Trainer gets it."""
    args = parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)  # the initial weights; the Trainer seeds itself (seed=0) for the rest
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    if model_hook is not None:
        model_hook(model)
    settings = dict(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=32, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, save_steps=4, seed=0,
        use_cpu=True, report_to=[], logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
    )
    settings.update(training_args or {})
    trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=token_dataset(),
                      data_collator=data_collator)
    trainer.train(resume_from_checkpoint=args.resume)


if __name__ == "__main__":
    main()
