"""Reading a checkpoint's files safely: only regular files inside the checkpoint directory, never
through a symlink or blocking on a FIFO, each with a size bound."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from samebits.checkpoint._errors import CheckpointError
from samebits.stream.file_kind import file_kind


def _open_regular(path: Path, what: str, shown: Path | None = None):
    """`path` opened for reading if it is a regular file, never through a symlink (which
    could lead out of the checkpoint) and never blocking (a FIFO would hang the load)."""
    flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
             | getattr(os, "O_CLOEXEC", 0))
    shown = shown or path
    try:
        if os.path.islink(path):  # O_NOFOLLOW refuses it too; this names the problem
            raise CheckpointError(f"{shown} is a symbolic link (to {os.readlink(path)}); {what} "
                                  "is read only as a regular file inside the checkpoint "
                                  "directory: replace the link by the file, or load an older "
                                  "step-K directory")
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{shown} is missing: the checkpoint is incomplete or was written "
                              "by another world size; load an older step-K directory") from None
    except OSError as err:
        raise CheckpointError(f"{shown} cannot be opened as {what} ({err}); load an older "
                              "step-K directory") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CheckpointError(f"{shown} is not a regular file ({file_kind(mode)}); {what} is "
                              "read only from a regular file inside the checkpoint directory: "
                              "load an older step-K directory")
    if flags & getattr(os, "O_NONBLOCK", 0):
        os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _read_regular(path: Path, limit: int, what: str, remedy: str, shown: Path | None = None) -> bytes:
    """The bytes of a regular file (`_open_regular`) of at most `limit` bytes."""
    shown = shown or path
    with _open_regular(path, what, shown) as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{shown} holds more than {limit} bytes, more than {what} can be: "
                              f"it is damaged or not a samebits file; {remedy}")
    return data


def _regular_size(path: Path, shown_from: Path) -> int:
    """Size of a shard file, refused unless it is a regular file (not a link) of the directory."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{shown_from} locates tensors in {path.name}, which is missing: the "
                              "checkpoint is incomplete; load an older step-K directory") from None
    if stat.S_ISLNK(info.st_mode):
        raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)}); a shard is "
                              "read only as a regular file inside the checkpoint directory: "
                              "replace the link by the file, or load an older step-K directory")
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{path} is not a regular file ({file_kind(info.st_mode)}); a shard "
                              "is read only from a regular file inside the checkpoint directory: "
                              "load an older step-K directory")
    return info.st_size

