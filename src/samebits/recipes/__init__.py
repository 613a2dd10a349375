"""The reference recipe: a small Nemotron-like MoE pretraining run, bitwise deterministic.

    from samebits.recipes import RecipeConfig, train
    result = train(RecipeConfig(), steps=10)

Command line: `python -m samebits.recipes --help`; see docs/recipe.md.
"""

from samebits.recipes.config import (
    PRESETS,
    RecipeConfig,
    default_config,
    nondeterministic_config,
)
from samebits.recipes.loop import TrainResult, session, train
from samebits.recipes.rules import register_recipe_rules  # importing registers the option rules

__all__ = [
    "RecipeConfig",
    "PRESETS",
    "default_config",
    "nondeterministic_config",
    "train",
    "TrainResult",
    "session",
]
