"""Planted fault: `load_state` leaves the optimizer as constructed (accelerate's optimizer
wrapper's `load_state_dict` patched to do nothing): AdamW's moments and step counts start
from zero, and its param groups keep the rate the scheduler set at construction.
Run: like train.py.
"""
from accelerate.optimizer import AcceleratedOptimizer

from train import main

AcceleratedOptimizer.load_state_dict = lambda self, state_dict: None  # PLANTED
main()
