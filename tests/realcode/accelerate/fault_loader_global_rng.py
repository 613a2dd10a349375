"""Planted fault: the DataLoader built as most examples build it, without a generator of its own.
Each `iter()` of it then draws its base seed from torch's global generator.  The resume restores
that generator with `load_state` and only then iterates the skipped loader: the draw lands after
the restore, and from step K on the attention dropout masks are other than A's.
Run: like train.py.
"""
from torch.utils.data import DataLoader

from train import main

main(make_loader=lambda windows: DataLoader(windows, batch_size=32, shuffle=True))  # PLANTED
