"""The reference recipe: a small Nemotron-like MoE pretraining run, bitwise deterministic.

``train(RecipeConfig(), steps=10)``; command line ``python -m samebits.recipes``; docs/recipe.md.
The names load on first use (PEP 562), so the command line reads `commands` and `cells` (no
torch) without loading the training code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOME = {
    "RecipeConfig": "samebits.recipes.config", "PRESETS": "samebits.recipes.config",
    "default_config": "samebits.recipes.config", "nondeterministic_config": "samebits.recipes.config",
    "train": "samebits.recipes.loop", "TrainResult": "samebits.recipes.loop", "session": "samebits.recipes.loop",
    "parse_cell": "samebits.recipes.cells", "cell_name": "samebits.recipes.cells",
    "ParallelDims": "samebits.recipes.cells",
    "register_recipe_rules": "samebits.recipes.rules",
}

if TYPE_CHECKING:  # what type checkers and IDEs see
    from samebits.recipes.cells import ParallelDims, cell_name, parse_cell
    from samebits.recipes.config import PRESETS, RecipeConfig, default_config, nondeterministic_config
    from samebits.recipes.loop import TrainResult, session, train
    from samebits.recipes.rules import register_recipe_rules


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'samebits.recipes' has no attribute {name!r}")
    if home != "samebits.recipes.cells":
        importlib.import_module("samebits.recipes.rules")  # importing registers the recipe's option rules
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = list(_HOME)
