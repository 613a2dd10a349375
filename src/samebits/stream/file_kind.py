"""What a path that is not a regular file is, in words: the stream reader and the checkpoint
loader both name it when they refuse one."""

from __future__ import annotations

import stat

_KINDS = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def file_kind(mode: int) -> str:
    """The words for the file type of ``mode`` (an ``st_mode``)."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")
