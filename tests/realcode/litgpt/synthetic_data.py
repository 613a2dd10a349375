"""A litgpt DataModule over synthetic tokens made in memory, for `litgpt pretrain --data synthetic_data.SyntheticTokens`.

litgpt's own pretraining data modules (TextFiles, TinyStories, LitData, ...) all read folders
prepared by LitData; this one holds overlapping windows of a seeded random Markov chain over
`vocab_size` tokens, so a run needs no files, tokenizer or downloads.  The train loader is
shuffled with its own seeded generator and is torchdata's `StatefulDataLoader` by default:
Fabric saves its position with the checkpoint and restores it on `--resume`.  `loader: plain`
gives a plain `torch.utils.data.DataLoader`, which has no state to save and restarts the epoch.
"""
from typing import Literal

import numpy as np
import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader


def markov_windows(num_windows: int, window: int, vocab_size: int, seed: int) -> torch.Tensor:
    """`num_windows` overlapping windows of `window` tokens from a random Markov chain: (num_windows, window)."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(vocab_size, 0.1), size=vocab_size).cumsum(axis=1)
    tokens, token = np.empty(num_windows + window, dtype=np.int64), 0
    for i, u in enumerate(rng.random(len(tokens))):
        token = min(int(np.searchsorted(table[token], u)), vocab_size - 1)
        tokens[i] = token
    tokens = torch.from_numpy(tokens)
    return torch.stack([tokens[i:i + window] for i in range(num_windows)])


class SyntheticTokens(DataModule):
    """Windows of `max_seq_length + 1` tokens (inputs and their next tokens), as litgpt's pretrain reads them.

    Args:
        num_train: windows in the train set (an epoch is num_train / micro_batch_size micro-batches).
        num_val: windows in the validation set.
        vocab_size: token ids drawn from [0, vocab_size); at most the model's vocabulary.
        loader: "stateful" (torchdata StatefulDataLoader, resumable) or "plain" (torch DataLoader).
        seed: the data's own seed (the chain and the shuffle order).
    """

    def __init__(self, num_train: int = 64, num_val: int = 8, vocab_size: int = 64,
                 loader: Literal["stateful", "plain"] = "stateful", seed: int = 0) -> None:
        super().__init__()
        self.num_train, self.num_val, self.vocab_size = num_train, num_val, vocab_size
        self.loader, self.seed = loader, seed
        self.batch_size, self.max_seq_length = 1, 16

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int = -1, **kwargs) -> None:
        self.batch_size = batch_size  # litgpt's micro-batch size
        self.max_seq_length = max_seq_length

    def setup(self, stage: str = "") -> None:
        window = self.max_seq_length + 1
        self.train_windows = markov_windows(self.num_train, window, self.vocab_size, self.seed)
        self.val_windows = markov_windows(self.num_val, window, self.vocab_size, self.seed + 1)

    def train_dataloader(self) -> DataLoader:
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader as loader_class
        else:
            loader_class = DataLoader  # PLANTED (loader: plain: Fabric pickles it into the checkpoint)
        return loader_class(self.train_windows, batch_size=self.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(self.seed))  # PLANTED (num_train 48: 2 epochs)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_windows, batch_size=self.batch_size)
