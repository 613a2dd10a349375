"""Planted fault: `load_state` leaves the LR scheduler as constructed (accelerate's scheduler
wrapper's `load_state_dict` patched to do nothing).  The optimizer's restored param groups hold
step K's learning rate, so step K is exact; the next `scheduler.step()` counts from 0 again and
step K+1 trains with the warmup's rate.
Run: like train.py.
"""
from accelerate.scheduler import AcceleratedScheduler

from train import main

AcceleratedScheduler.load_state_dict = lambda self, state_dict: None  # PLANTED
main()
