"""Runs of training commands, launched and judged: the top library layer.

    verify_recipe / verify_command   the two guarantees (A = B; A = C resumed from A's checkpoint)
    bisect                           narrow a divergence to its origin, one tracing rung at a time

Both start training as separate processes (the reference recipe, or any command under
zero-code recording) through one launcher (`_launch`: logged, time-bounded, judged by how each
process's own code ended), then compare the recorded streams with `samebits.compare` and
classify with `samebits.trace`.  See docs/architecture.md.
"""

from samebits.runs.bisect import BisectResult, bisect
from samebits.runs.verify import VerifyResult, verify_command, verify_recipe

__all__ = ["verify_recipe", "verify_command", "VerifyResult", "bisect", "BisectResult"]
