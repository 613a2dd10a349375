"""The reference recipe: a small Nemotron-like MoE pretraining run, bitwise deterministic.

    from samebits.recipes import RecipeConfig, train
    result = train(RecipeConfig(), steps=10)
    cfg = RecipeConfig(**parse_cell("tp2-dp2"))     # a parallel cell (run it on 4 ranks)

Command line: `python -m samebits.recipes --help`; see docs/recipe.md.
"""

from samebits.recipes.config import (
    PRESETS,
    RecipeConfig,
    default_config,
    nondeterministic_config,
)
from samebits.recipes.loop import TrainResult, session, train
from samebits.recipes.parallelize import ParallelDims, cell_name, parse_cell
from samebits.recipes.rules import register_recipe_rules  # importing registers the option rules

__all__ = [
    "RecipeConfig",
    "PRESETS",
    "default_config",
    "nondeterministic_config",
    "train",
    "TrainResult",
    "session",
    "parse_cell",
    "cell_name",
    "ParallelDims",
    "register_recipe_rules",
]
