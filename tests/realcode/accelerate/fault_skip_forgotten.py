"""Planted fault: `skip_first_batches` does nothing (patched from outside, as when a resume path
forgets it): the resumed loop starts the epoch at its first batch, so step K trains on the batch
of step 0 again.
Run: like train.py.
"""
from accelerate import Accelerator

from train import main

Accelerator.skip_first_batches = lambda self, dataloader, num_batches=0: dataloader  # PLANTED
main()
