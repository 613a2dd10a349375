"""The defaults of the commands that launch runs, in a module that loads nothing.

The library uses them (`samebits.runs`), and the command line shows them in ``--help``: from
here it can, without importing the library (and torch), so that printing help takes a blink.
One definition each; the library modules re-export them under their old names.
"""

from __future__ import annotations

DEFAULT_TIMEOUT_S = 1800.0  # one training run (verify, bisect, tax, matrix): killed and reported as a hang after this

DEFAULT_GATE = 1.05  # samebits tax: the largest determinism tax (deterministic / baseline step time) that passes

# samebits matrix
DEFAULT_CELLS = ("single", "dp2", "ep2")
DEFAULT_PRECISIONS = ("fp32", "bf16", "fp8_delayed")
DEFAULT_MAX_WORLD_SIZE = 8
DEFAULT_GLOBAL_BATCH = 8
# Per-replica randomness and per-rank losses make layouts differ by more than rounding:
# dropout and router jitter draw per data-parallel replica, and the load-balancing loss is
# each rank's own.  Off, two layouts compute the same function of the same global batch.
LAYOUT_INDEPENDENT = ("dropout=0", "moe_jitter_eps=0", "moe_aux_loss_coeff=0")

__all__ = ["DEFAULT_TIMEOUT_S", "DEFAULT_GATE", "DEFAULT_CELLS", "DEFAULT_PRECISIONS", "DEFAULT_MAX_WORLD_SIZE",
           "DEFAULT_GLOBAL_BATCH", "LAYOUT_INDEPENDENT"]
