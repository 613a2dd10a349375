"""Planted fault: a per-token bias added to GPT-2's token embeddings by a forward hook registered
from outside the model (`model_hook`).  `token_bias[input_ids]` is advanced indexing: its
backward is index_put_ with accumulate=True, which on CPU with 2 threads adds the rows of
repeated tokens (32 x 32 tokens over 64 ids) in thread arrival order: the gradient differs
run to run.
Run: like train.py.
"""
import torch

from train import main


def add_token_bias(model):
    embedding = model.transformer.wte
    embedding.token_bias = torch.nn.Parameter(torch.zeros_like(embedding.weight))

    def hook(module, inputs, output):
        return output + module.token_bias[inputs[0]]  # PLANTED

    embedding.register_forward_hook(hook)


main(model_hook=add_token_bias)
