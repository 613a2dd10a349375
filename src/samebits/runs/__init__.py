"""Runs of training commands, launched and judged: the top library layer.

    samebits.runs.verify.verify   the two guarantees (A = B; A = C resumed from A's checkpoint)
    samebits.runs.bisect.bisect   narrow a divergence to its origin, one tracing rung at a time

(each function is named after its module, so the package does not export it: a submodule
imported first would take the name).

Both run a `samebits.runs.program.Program` (the reference recipe, which records itself, or
any command under zero-code recording) as separate processes through one launcher (`_launch`:
logged, time-bounded, judged by how each process's own code ended), then compare the recorded
streams with `samebits.compare` and classify with `samebits.trace`.  See docs/architecture.md.
Importing the package loads no torch (its names load on first use), so the command line can
check its arguments with `samebits.runs.commands` before it loads the library.
"""

from samebits._lazy_exports import lazy_exports

_LAZY = {"VerifyResult": "verify", "BisectResult": "bisect", "Program": "program",
         "SelfRecording": "program", "ZeroCode": "program"}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = ["VerifyResult", "BisectResult", "Program", "SelfRecording", "ZeroCode"]
