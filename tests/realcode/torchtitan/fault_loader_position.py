"""Planted fault: torchtitan's text dataset restores its buffers on resume but not its position.

`HuggingFaceTextDataset.load_state_dict` is replaced by one that restores the token buffers
and the epoch, as torchtitan's does, and forgets `sample_idx`: the resumed run reads the
dataset again from its first document, so its batches from the resume step on are A's
earliest ones.  One method of torchtitan is patched from outside; the rest is its own code.

Run as launch.py is run:  python fault_loader_position.py --module tiny_llama3 --config tiny --dump_folder OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402

launch.prepare()
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset  # noqa: E402


def load_state_dict(self, state_dict):
    self._inputs_buffer = state_dict["inputs_buffer"]
    self._labels_buffer = state_dict["labels_buffer"]
    self._positions_buffer = state_dict.get("positions_buffer", [])
    self._epoch = state_dict.get("epoch", 0)  # PLANTED sample_idx is not restored: reading restarts at document 0


HuggingFaceTextDataset.load_state_dict = load_state_dict
launch.run()
