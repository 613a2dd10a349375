"""Planted fault: a data collator (the Trainer's `data_collator` knob) that masks 10% of the
input tokens with `np.random.default_rng()` made without a seed.  The Trainer's `seed` seeds
Python, NumPy's global state and torch, not this generator: every run trains on other inputs.
Run: like train.py.
"""
import numpy as np
import torch

from train import main

mask_rng = np.random.default_rng()  # PLANTED


def collate(samples):
    ids = torch.stack([sample["input_ids"] for sample in samples])
    masked = torch.from_numpy(mask_rng.random(ids.shape) < 0.1)
    return {"input_ids": ids.masked_fill(masked, 0), "labels": ids}


main(data_collator=collate)
