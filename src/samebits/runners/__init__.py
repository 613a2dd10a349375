"""Runs of training commands, launched and judged: the top library layer (docs/architecture.md).

verify, bisect, matrix, tax and ``verify --across`` each run a `samebits.runners.program.Program`
through one launcher (`_launch`) and compare what was recorded.  Each function is named after
its module, so the package exports none (a submodule imported first would take the name), and
importing it loads no torch: the command line checks arguments with `samebits.runners.commands` first.
"""

from samebits._lazy_exports import lazy_exports

_LAZY = {"VerifyResult": "verify", "BisectResult": "bisect", "Program": "program",
         "SelfRecording": "program", "ZeroCode": "program"}

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())

__all__ = ["VerifyResult", "BisectResult", "Program", "SelfRecording", "ZeroCode"]
