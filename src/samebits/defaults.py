"""The defaults of the commands that launch runs, in a module that loads nothing, so that
``--help`` can show them without importing the library (and torch).
"""

from __future__ import annotations

DEFAULT_TIMEOUT_S = 1800.0  # one training run (verify, bisect, tax, matrix): killed and reported as a hang after this

DEFAULT_GATE = 1.05  # samebits tax: the largest determinism tax (deterministic / baseline step time) that passes

# samebits matrix (the recipe's cells, precisions and batch: samebits.recipes.commands)
DEFAULT_MAX_WORLD_SIZE = 8

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_GATE", "DEFAULT_MAX_WORLD_SIZE"]
