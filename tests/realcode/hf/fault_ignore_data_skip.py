"""Planted fault: `TrainingArguments(ignore_data_skip=True)` (a knob the Trainer offers, to make
resuming start faster).  The resumed Trainer restores the model, optimizer, scheduler and RNG
states, but starts the epoch's batches from the first again: step K trains on step 0's batch.
Run: like train.py.
"""
from train import main

main(training_args={"ignore_data_skip": True})  # PLANTED
