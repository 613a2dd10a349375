"""Errors of `samebits.checkpoint` (under the project's root `SamebitsError`)."""

from __future__ import annotations

from samebits.errors import SamebitsError


class CheckpointError(SamebitsError):
    """A checkpoint is missing, incomplete, of another format, or does not fit the bundle.

    The message names the checkpoint directory, the rank and the entry at fault.
    """


class CheckpointLayoutError(CheckpointError):
    """The checkpoint was written by another world size or parallel layout, and cannot be
    loaded under this one.

    Without `load(..., allow_layout_change=True)` any other layout is refused: resume with
    the world size and layout stored in the checkpoint's meta.json.  With it, what cannot
    move bitwise is refused by name: a value or random stream that differs per saved rank,
    a rank-local tensor with no place in a global one (`StateBundle.shards`), pieces that do
    not tile their tensor.
    """


class MalformedFieldError(CheckpointError):
    """One field of a saved state is not what `save` (or `capture_rng_state`) writes.

    `field` names it as a dotted path (``numpy.pos``, ``generators.data``), `problem` says
    what is wrong with it.  `load` re-raises it as a `CheckpointError` that also names the
    file; `restore_rng_state` raises it as is.
    """

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"random state field {field or '(the whole state)'}: {problem}; it is "
                         "not a state that capture_rng_state returns")
