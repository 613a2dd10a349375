"""Planted faults for the litgpt pretrain cases, applied from outside litgpt by launch.py --fault NAME.

Each fault takes litgpt's command-line arguments and returns them (changed only by time_seed); it
changes one thing through a knob litgpt leaves open (its seed argument), a small patch of one
method of torch, Fabric or torchdata, or a forward hook, the way a user's own wrapper or a library bug
would; litgpt's training code itself is untouched.  The line each case's `planted` names is
marked PLANTED in a comment.
"""
import time

import torch
from torch import nn


def no_optimizer_load(argv):
    """The resume restores the model, loader and counters but not AdamW's moments and step counts.
    (Fabric.load hands the checkpoint to the unwrapped optimizer, so the patch is on AdamW itself.)"""
    torch.optim.AdamW.load_state_dict = lambda self, state_dict: None  # PLANTED
    return argv


def counters_not_restored(argv):
    """The resume loads the checkpoint but keeps the fresh iter_num and step_count (0): litgpt's
    learning rate comes from iter_num, so the resumed run restarts the warmup."""
    from lightning.fabric import Fabric

    original_load = Fabric.load

    def load(self, path, state=None, strict=True, **kwargs):
        fresh = {key: state[key] for key in ("iter_num", "step_count") if state and key in state}
        remainder = original_load(self, path, state, strict=strict, **kwargs)
        state.update(fresh)  # PLANTED
        return remainder

    Fabric.load = load
    return argv


def loader_not_restored(argv):
    """The resume restores everything but the data loader's position: the loader restarts its epoch."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    StatefulDataLoader.load_state_dict = lambda self, state_dict: None  # PLANTED
    return argv


def embedding_index_put(argv):
    """A forward hook on every nn.Embedding adds a per-token bias gathered with index_put_(accumulate=True)
    over many repeated rows: float atomic adds on 2 CPU threads, summed in arrival order."""

    def hook(module, inputs, output):
        if not isinstance(module, nn.Embedding):
            return None
        rows = output.detach().reshape(-1, output.shape[-1]).repeat(256, 1)  # (N, C), N >= 32768 / C
        slots = inputs[0].reshape(-1).repeat(256) % 8
        bias = output.new_zeros(8, output.shape[-1]).index_put_((slots,), rows, accumulate=True)  # PLANTED
        return output + 1e-3 * bias[inputs[0] % 8]

    nn.modules.module.register_module_forward_hook(hook)
    return argv


def time_seed(argv):
    """litgpt's `seed` taken from the clock: initial weights and the loader's shuffle differ every run."""
    return [*argv, "--seed", str(time.time_ns() % 2**31)]  # PLANTED


FAULTS = {fault.__name__: fault for fault in (no_optimizer_load, counters_not_restored, loader_not_restored,
                                              embedding_index_put, time_seed)}
