"""Planted fault: `TrainingArguments(save_only_model=True)` (a knob the Trainer offers, to make
checkpoints smaller).  Each checkpoint-N/ then holds the weights and trainer_state.json but no
optimizer.pt, scheduler.pt or rng_state.pth; resuming from it starts AdamW's moments (and the
LR schedule and RNG) afresh, and the Trainer says nothing.
Run: like train.py.
"""
from train import main

main(training_args={"save_only_model": True})  # PLANTED
