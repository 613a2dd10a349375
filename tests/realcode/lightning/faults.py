"""Planted faults for the Lightning cases, applied from outside Lightning by train.py --fault NAME.

Each fault patches one method of Lightning or registers one hook, the way a user's own wrapper or
a library bug would, or changes the seed the launcher passes to `lightning.seed_everything`;
Lightning's training code itself is untouched.  Each takes the launcher's parsed arguments.  The
line each case's `planted` names is marked PLANTED in a comment.
"""
import time

from torch import nn


def skip_optimizer_restore(args):
    """trainer.fit(ckpt_path=...) restores everything but the optimizer: AdamW restarts with empty moments."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    _CheckpointConnector.restore_optimizers = lambda self: None  # PLANTED


def skip_scheduler_restore(args):
    """trainer.fit(ckpt_path=...) restores everything but the LR scheduler: its step count restarts at 0."""
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    _CheckpointConnector.restore_lr_schedulers = lambda self: None  # PLANTED


def embedding_index_put(args):
    """A forward hook on every nn.Embedding adds a per-token bias gathered with index_put_(accumulate=True)
    over many repeated rows: float atomic adds on 2 CPU threads, summed in arrival order."""

    def hook(module, inputs, output):
        if not isinstance(module, nn.Embedding):
            return None
        rows = output.detach().reshape(-1, output.shape[-1]).repeat(64, 1)  # (N, C), N * C >> 32768
        slots = inputs[0].reshape(-1).repeat(64) % 8
        bias = output.new_zeros(8, output.shape[-1]).index_put_((slots,), rows, accumulate=True)  # PLANTED
        return output + 1e-3 * bias[inputs[0] % 8]

    nn.modules.module.register_module_forward_hook(hook)


def time_seed(args):
    """lightning.seed_everything from the clock: initial weights, shuffle and dropout differ every run."""
    args.seed = time.time_ns() % 2**31  # PLANTED


FAULTS = {fault.__name__: fault for fault in (skip_optimizer_restore, skip_scheduler_restore, embedding_index_put,
                                              time_seed)}
