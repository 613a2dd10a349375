"""Optimizer and learning-rate schedule of the reference recipe (both checkpointable)."""

from __future__ import annotations

import math

import torch
from torch import nn

from samebits.recipes.config import RecipeConfig


class WarmupCosine:
    """LambdaLR factor: linear warm-up, cosine decay to min_lr / lr, then constant.

    A callable object, not a closure: LambdaLR stores its `__dict__` (plain numbers) in the
    scheduler state, so the schedule is part of a checkpoint.
    """

    def __init__(self, warmup_steps: int, decay_steps: int, min_ratio: float):
        self.warmup_steps, self.decay_steps, self.min_ratio = warmup_steps, decay_steps, min_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.decay_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: RecipeConfig):
    """AdamW (weight decay on matrices and embeddings only) and its LambdaLR schedule."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
        foreach=False,  # the plain per-parameter loop: same code path on every machine
    )
    schedule = WarmupCosine(cfg.warmup_steps, cfg.lr_decay_steps, cfg.min_lr / cfg.lr
                            if cfg.lr > 0 else 1.0)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
