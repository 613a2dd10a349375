"""Errors of `samebits.checkpoint` (under the project's root `SamebitsError`)."""

from __future__ import annotations

from samebits.errors import SamebitsError


class CheckpointError(SamebitsError):
    """A checkpoint is missing, incomplete, of another format, or does not fit the bundle.

    The message names the checkpoint directory, the rank and the entry at fault.
    """


class CheckpointLayoutError(CheckpointError):
    """The checkpoint was written by another world size or parallel layout.

    A bitwise resume needs every rank's own random states, data position and shards back on
    the same rank, so resharding is refused: resume with the world size and layout stored
    in the checkpoint's meta.json.
    """
