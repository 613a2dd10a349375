"""The seed rule: every seed of a run is derived from one base seed and the rank coordinates
that the seed's purpose must vary with.

=========  ===============================  ==========================================
purpose    varies with                      why
=========  ===============================  ==========================================
init       nothing (same on every rank)     every DP replica starts from the same
                                            weights; shards slice one global init, so
                                            TP/PP/EP layout does not change the values
data       dp_rank                          each data-parallel replica samples its own
                                            batches; its TP/PP/EP peers see the same ones
dropout    dp_rank, pp_rank                 masks over replicated activations must match
                                            across TP ranks; stages hold different layers
dropout_tp dp_rank, pp_rank, tp_rank        masks over TP-sharded activations differ per
                                            shard (Megatron's model-parallel RNG tracker)
expert     dp_rank, pp_rank, ep_rank,       expert ranks hold different experts and tokens
           tp_rank                          (Megatron's expert-parallel RNG)
=========  ===============================  ==========================================

A derived seed is the first 63 bits of SHA-256 over the rule version, the base seed, the
purpose and the coordinates it varies with; coordinates it does not vary with are
ignored, so callers can always pass all of theirs.  Hashing (not ``base + 100 * rank``)
keeps the streams of different purposes and ranks from overlapping.
"""

from __future__ import annotations

import hashlib
import random

from samebits.errors import ConfigError

SEED_RULE_VERSION = "samebits-seed/1"

SEED_PURPOSES: dict[str, tuple[str, ...]] = {
    "init": (),
    "data": ("dp_rank",),
    "dropout": ("dp_rank", "pp_rank"),
    "dropout_tp": ("dp_rank", "pp_rank", "tp_rank"),
    "expert": ("dp_rank", "pp_rank", "ep_rank", "tp_rank"),
}

def derive_seed(base: int, *, purpose: str, dp_rank: int = 0, tp_rank: int = 0,
                pp_rank: int = 0, ep_rank: int = 0) -> int:
    """The seed for `purpose` on the rank with these coordinates (see the table above).

    Returns an int in [0, 2**63), accepted by torch, NumPy (via `seed_all`) and `random`.
    """
    if isinstance(base, bool) or not isinstance(base, int):
        raise ConfigError(f"base seed must be an int, got {base!r}")
    if purpose not in SEED_PURPOSES:
        raise ConfigError(f"unknown seed purpose {purpose!r}; known purposes: "
                         f"{', '.join(SEED_PURPOSES)}")
    ranks = {"dp_rank": dp_rank, "tp_rank": tp_rank, "pp_rank": pp_rank, "ep_rank": ep_rank}
    for name, value in ranks.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
    used = ",".join(f"{name}={ranks[name]}" for name in SEED_PURPOSES[purpose])
    digest = hashlib.sha256(f"{SEED_RULE_VERSION}|{base}|{purpose}|{used}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_all(seed: int) -> dict:
    """Seed Python's `random`, NumPy's global RNG and torch (CPU and every CUDA device).

    NumPy's legacy seed takes 32-bit words, so the 63-bit seed is passed as two words.
    Returns what was seeded, for the record.
    """
    import torch

    random.seed(seed)
    seeded = {"python": seed, "torch": seed}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    else:
        np.random.seed([seed & 0xFFFFFFFF, seed >> 32])
        seeded["numpy"] = [seed & 0xFFFFFFFF, seed >> 32]
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily if CUDA is not started)
    seeded["cuda"] = seed if torch.cuda.is_available() else None
    return seeded
