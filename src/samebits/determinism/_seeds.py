"""The seed rule: every seed of a run is derived from one base seed and the rank coordinates
that the seed's purpose must vary with (docs/determinism.md, "The seed rule", has the table of
purposes and why).  Hashing (not ``base + 100 * rank``) keeps the streams of different
purposes and ranks from overlapping.
"""

from __future__ import annotations

import hashlib
import random
from typing import Mapping, Sequence

from samebits.errors import ConfigError

SEED_RULE_VERSION = "samebits-seed/1"

SEED_PURPOSES: dict[str, tuple[str, ...]] = {
    "init": (),
    "data": ("dp",),
    "dropout": ("dp", "pp"),
    "dropout_tp": ("dp", "pp", "tp"),
    "expert": ("dp", "pp", "ep", "tp"),
}


def check_coordinates(coordinates: Mapping[str, int] | None) -> dict[str, int]:
    """``coordinates`` as a dict (None: none), or a ConfigError naming what is wrong."""
    if not isinstance(coordinates, (Mapping, type(None))):
        raise ConfigError(f"coordinates must be a mapping of axis to index, e.g. {{'dp': 0, 'tp': 1}}, "
                          f"got {coordinates!r}")
    for axis, index in (coordinates or {}).items():
        if not isinstance(axis, str) or isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ConfigError(f"coordinates[{axis!r}] must be a non-negative int index on a named axis, "
                              f"got {index!r}")
    return dict(coordinates or {})


def derive_seed(base: int, *, purpose: str, coordinates: Mapping[str, int] | None = None,
                varies_with: Sequence[str] | None = None) -> int:
    """The seed in [0, 2**63) for `purpose` on the rank at ``coordinates``; ``varies_with``
    names the axes of a purpose `SEED_PURPOSES` does not have."""
    if isinstance(base, bool) or not isinstance(base, int):
        raise ConfigError(f"base seed must be an int, got {base!r}")
    if varies_with is None and purpose not in SEED_PURPOSES:
        raise ConfigError(f"unknown seed purpose {purpose!r}; known purposes: {', '.join(SEED_PURPOSES)} "
                          "(or name the axes a new one varies with: varies_with=('dp', ...))")
    coordinates = check_coordinates(coordinates)
    axes = SEED_PURPOSES[purpose] if varies_with is None else tuple(varies_with)
    used = ",".join(f"{axis}_rank={coordinates.get(axis, 0)}" for axis in axes)
    digest = hashlib.sha256(f"{SEED_RULE_VERSION}|{base}|{purpose}|{used}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_all(seed: int) -> dict:
    """Seed Python's `random`, NumPy's global RNG (two 32-bit words) and torch (CPU and every
    CUDA device); returns what was seeded, for the record."""
    import torch

    import numpy as np

    random.seed(seed)
    words = [seed & 0xFFFFFFFF, seed >> 32]
    np.random.seed(words)
    seeded = {"python": seed, "torch": seed, "numpy": words}
    torch.manual_seed(seed)  # also seeds every CUDA device (lazily if CUDA is not started)
    seeded["cuda"] = seed if torch.cuda.is_available() else None
    return seeded
