"""Errors of `samebits.checkpoint` (under the project's root `SamebitsError`)."""

from __future__ import annotations

from samebits.errors import SamebitsError


class CheckpointError(SamebitsError):
    """A checkpoint is missing, incomplete, of another format, or does not fit the bundle;
    the message names the checkpoint directory, the rank and the entry at fault."""


class CheckpointLayoutError(CheckpointError):
    """The checkpoint was written by another world size or parallel layout and cannot be
    loaded under this one: without `load(..., allow_layout_change=True)` any other layout;
    with it, what cannot move bitwise (docs/checkpoint.md, "Load under another layout")."""


class MalformedFieldError(CheckpointError):
    """One field of a saved state (`field`, a dotted path such as ``numpy.pos``) is not what
    `save` or `capture_rng_state` writes; `problem` says why.  `load` re-raises it naming the file."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"random state field {field or '(the whole state)'}: {problem}; it is "
                         "not a state that capture_rng_state returns")
