"""Deterministic data for the reference recipe: sample i is a pure function of (seed, i).

`SyntheticTokens` (a seeded Markov chain) and `TokenFile` (a flat token array in a seeded order
per epoch) share `tokens(indices)`; `Batches` splits a step's global batch by rank, so it does
not depend on the world size and `consumed_samples` is all a resume needs (docs/recipe.md, "Data").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from samebits.errors import ConfigError
from samebits.recipes.config import RecipeConfig

_SUCCESSOR_PROBS = np.array([0.6, 0.25, 0.1, 0.05])  # skewed: entropy ~1.1 nats per token


class SyntheticTokens:
    """Seeded Markov-chain token stream."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        table_rng = np.random.Generator(np.random.Philox(key=[seed, 2**63]))
        self.successors = table_rng.integers(0, vocab_size, (vocab_size, len(_SUCCESSOR_PROBS)))
        self.cdf = np.cumsum(_SUCCESSOR_PROBS)
        self.cdf[-1] = 1.0

    def tokens(self, indices: np.ndarray) -> np.ndarray:
        """(n,) global sample indices -> (n, seq_len + 1) int64 tokens."""
        uniforms = np.stack([
            np.random.Generator(np.random.Philox(key=[self.seed, int(i)])).random(self.seq_len + 1)
            for i in indices
        ])  # (n, L+1)
        out = np.empty(uniforms.shape, dtype=np.int64)
        out[:, 0] = (uniforms[:, 0] * self.vocab_size).astype(np.int64)
        for t in range(1, uniforms.shape[1]):
            choice = np.searchsorted(self.cdf, uniforms[:, t], side="right")
            out[:, t] = self.successors[out[:, t - 1], np.minimum(choice, len(self.cdf) - 1)]
        return out


class TokenFile:
    """Flat uint16/uint32 token file, memory-mapped; samples in a seeded order per epoch."""

    def __init__(self, path: str | Path, dtype: str, vocab_size: int, seq_len: int, seed: int):
        self.path, self.vocab_size, self.seq_len, self.seed = Path(path), vocab_size, seq_len, seed
        if not self.path.is_file():
            raise ConfigError(f"data_path={str(path)!r} is not a file; give a flat binary token "
                             f"array ({dtype}) or leave data_path unset for synthetic data")
        self.data = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        self.num_samples = (len(self.data) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(f"data_path={str(path)!r} holds {len(self.data)} {dtype} tokens, "
                             f"fewer than one sample of seq_len + 1 = {seq_len + 1}")
        self._cached_epoch, self._cached_order = -1, np.empty(0, dtype=np.int64)

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order (kept for the current epoch only)."""
        if self._cached_epoch != epoch:
            rng = np.random.Generator(np.random.Philox(key=[self.seed, epoch]))
            self._cached_order, self._cached_epoch = rng.permutation(self.num_samples), epoch
        return self._cached_order

    def tokens(self, indices: np.ndarray) -> np.ndarray:
        rows = []
        for index in indices:
            epoch, position = divmod(int(index), self.num_samples)
            start = int(self._order(epoch)[position]) * self.seq_len
            rows.append(self.data[start:start + self.seq_len + 1].astype(np.int64))
        out = np.stack(rows)
        if out.max() >= self.vocab_size:
            bad = int(np.argwhere(out >= self.vocab_size)[0][0])
            raise ConfigError(f"{self.path}: sample {int(indices[bad])} holds token "
                             f"{int(out[bad].max())} >= vocab_size={self.vocab_size}; "
                             "raise vocab_size or check data_dtype")
        return out


def build_token_source(cfg: RecipeConfig) -> SyntheticTokens | TokenFile:
    if cfg.data_path is None:
        return SyntheticTokens(cfg.vocab_size, cfg.seq_len, cfg.seed)
    return TokenFile(cfg.data_path, cfg.data_dtype, cfg.vocab_size, cfg.seq_len, cfg.seed)


class Batches:
    """This rank's micro-batches in global-sample-index order; the position is state."""

    def __init__(self, source, micro_batch_size: int, rank: int, world_size: int):
        self.source, self.micro_batch_size = source, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.consumed_samples = 0  # global samples consumed by all ranks together

    def indices(self) -> np.ndarray:
        """Global sample indices of this rank's next micro-batch."""
        start = self.consumed_samples + self.rank * self.micro_batch_size
        return np.arange(start, start + self.micro_batch_size)

    def next(self) -> torch.Tensor:
        """(micro_batch_size, seq_len + 1) int64 tokens; advances the position."""
        batch = torch.from_numpy(self.source.tokens(self.indices()))
        self.consumed_samples += self.micro_batch_size * self.world_size  # the global batch
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed_samples = int(state["consumed_samples"])
