"""Planted fault: `TrainingArguments(data_seed=...)` (the knob that seeds the Trainer's data
sampler apart from `seed`) set from the clock.  accelerate's SeedableRandomSampler seeds its
own generator with it: every run trains on the batches in another order.
Run: like train.py.
"""
import time

from train import main

main(training_args={"data_seed": int(time.time() * 1000) % 2**31})  # PLANTED
