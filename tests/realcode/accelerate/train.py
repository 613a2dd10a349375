"""A user's training loop with accelerate 1.15.0, as its documentation writes one: `Accelerator`,
`prepare`, `accelerator.backward`, `save_state` every few steps, and on resume `load_state` plus
`skip_first_batches`.  A tiny Llama (2 layers, from its config object, attention dropout 0.1)
on random token windows made in memory: no tokenizer, no downloads.

With accelerate the loop is the user's by nature; everything it calls is accelerate's (and
transformers') installed code.  The fault wrappers (fault_*.py) patch one accelerate method from
outside, or pass a hook, and then run this loop as it is.

Run:    python train.py --out DIR [--steps 8]               # DIR/step_4, DIR/step_8 (save_state)
        python train.py --out DIR --resume DIR_A/step_4      # load_state, skip the epoch's 4 batches
"""
import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where save_state writes step_N/")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--resume", default=None, help="a step_N folder that save_state wrote")
    return parser.parse_args()


def main(model_hook=None, make_loader=None):
    """Train; `model_hook(model)` may change the model and `make_loader(windows)` build the
    DataLoader, from outside (the fault wrappers)."""
    args = parse_args()
    torch.set_num_threads(2)
    # the seedable sampler shuffles each epoch from (seed, epoch): a resumed run sees the same order
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                         attention_dropout=0.1)
    model = LlamaForCausalLM(config)
    if model_hook is not None:
        model_hook(model)
    windows = torch.randint(0, 64, (384, 32), generator=torch.Generator().manual_seed(1))
    # the loader's own generator: an iterator then draws its base seed from it, not from torch's
    # global RNG, which load_state restores (a draw after the restore would shift dropout)
    loader = (make_loader or (lambda data: DataLoader(data, batch_size=32, shuffle=True,
                                                      generator=torch.Generator().manual_seed(0))))(windows)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=args.steps)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        step = int(os.path.basename(os.path.normpath(args.resume)).removeprefix("step_"))
    epoch, done_in_epoch = divmod(step, len(loader))
    model.train()
    while step < args.steps:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, done_in_epoch) if done_in_epoch else loader
        for batch in batches:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            accelerator.print(f"step {step} loss {loss.item():.6f}")
            step += 1
            if step % args.save_every == 0:
                accelerator.save_state(os.path.join(args.out, f"step_{step}"))
            if step == args.steps:
                break
        epoch, done_in_epoch = epoch + 1, 0


if __name__ == "__main__":
    main()
