"""Planted fault: a forward hook on torchtitan's token embedding sums each token's vectors with
`index_put_(..., accumulate=True)`.

The hook (registered from outside, by patching `Embedding.__init__` to add it) adds a
"recency-weighted bag of same tokens" feature: every position gets the mean, over the positions
in the batch holding its token, of their embeddings weighted by 1/(1 + position).  The sums are
made by index_put_ with accumulate=True, which on CPU (float32, 2 threads, many repeated tokens,
a different value at each occurrence) adds the rows in thread arrival order: the forward output
itself differs run to run.  (Unweighted, every occurrence of a token adds the same vector, and
adding equal values gives the same sum in any order: no fault.)  The read back is `index_select`,
whose backward (index_add_) is order-stable, so the first difference is in the forward.
The rest is torchtitan's own code.

Run as launch.py is run:  python fault_hook_index_put.py --module tiny_llama3 --config tiny --dump_folder OUT
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import launch  # noqa: E402

launch.prepare()
import torch  # noqa: E402
from torchtitan.models.common.embedding import Embedding  # noqa: E402


def bag_of_same_tokens(module, inputs, output):
    tokens = inputs[0]  # (B, L)
    position = torch.arange(tokens.shape[-1], dtype=output.dtype, device=output.device)
    weighted = output / (1 + position).unsqueeze(-1)  # (B, L, D): each occurrence its own value
    bags = output.new_zeros(module.num_embeddings, output.shape[-1])
    bags = bags.index_put((tokens,), weighted, accumulate=True)  # PLANTED order-dependent sums in the forward
    counts = torch.bincount(tokens.flatten(), minlength=module.num_embeddings).clamp(min=1)
    mean = bags.index_select(0, tokens.flatten()) / counts[tokens.flatten()].unsqueeze(-1).to(output.dtype)
    return output + mean.view_as(output)


original_init = Embedding.__init__


def __init__(self, config):
    original_init(self, config)
    self.register_forward_hook(bag_of_same_tokens)


Embedding.__init__ = __init__
launch.run()
