"""Planted fault: the resume skips loading rng_state.pth, through a wrapper that patches one
method of the installed Trainer (as a user who "speeds up" resuming, or a broken subclass,
would).  GPT-2's dropout then draws other masks from step K on.
Run: like train.py.
"""
from transformers import Trainer

from train import main

Trainer._load_rng_state = lambda self, checkpoint: None  # PLANTED
main()
