"""samebits: make PyTorch pretraining bitwise deterministic, and prove it.

The public API is what ``__all__`` lists; every other module is private.
"""

from samebits.errors import DeterminismError, IncomparableRunsError, SamebitsError, StreamError

__version__ = "0.1.0"

__all__ = [
    "SamebitsError",
    "StreamError",
    "IncomparableRunsError",
    "DeterminismError",
]
