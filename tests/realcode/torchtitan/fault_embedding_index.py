"""Planted fault: torchtitan's token embedding looks rows up by advanced indexing.

`self.weight[tokens]` gives the same forward values as `F.embedding`, but its backward is
`index_put_` with accumulate=True, which on CPU (float32, 2+ threads, many repeated tokens) adds
the rows of repeated tokens in thread arrival order: the embedding's gradient differs run to run.
One method of torchtitan is patched from outside (`Embedding.forward`); the rest is its own code.

Run as launch.py is run:  python fault_embedding_index.py --module tiny_llama3 --config tiny --dump_folder OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402

launch.prepare()
from torchtitan.models.common.embedding import Embedding  # noqa: E402


def forward(self, input):
    return self.weight[input]  # PLANTED index_put_ accumulate in backward


Embedding.forward = forward
launch.run()
