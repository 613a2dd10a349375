"""Planted fault: torchtitan's text dataset reshuffles each new epoch with a clock-seeded generator.

torchtitan's `HuggingFaceTextDataset.reloop` reshuffles the documents at each new epoch with
a fixed seed (42 + epoch).  Here it is replaced by one that draws the order from a private
`torch.Generator` seeded from the clock: the data order after the first epoch, and every
step from there on, differs run to run.  The small dataset (assets.py) ends its first epoch
within the run.  One method of torchtitan is patched from outside; the rest is its own code.

Run as launch.py is run:  python fault_reloop_time_seed.py --module tiny_llama3 --config tiny --dump_folder OUT
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402

launch.prepare()
import torch  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset  # noqa: E402


def reloop(self):
    self._sample_idx = 0
    self._epoch += 1
    order = torch.Generator().manual_seed(time.time_ns())  # PLANTED a clock-seeded shuffle
    self._data = self._original_data.select(torch.randperm(len(self._original_data), generator=order).tolist())


HuggingFaceTextDataset.reloop = reloop
launch.run()
