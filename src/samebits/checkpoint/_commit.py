"""Committing a checkpoint so that at every instant ROOT/latest names a complete one (`_commit`),
finishing or removing a killed save's leftovers, and `resolve`: the checkpoint a path names."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from samebits.checkpoint._errors import CheckpointError
from samebits.checkpoint._regular import _read_regular

LATEST = "latest"
_LATEST_MAX_BYTES = 4096  # the most `latest` can hold (a bigger one is damage)
# Directories of a commit in progress (see `_commit`); only `latest` can make one of them live.
_STAGED, _ASIDE, _LINKED = ".staged-", ".old-", ".link-"


def _commit(root: Path, complete: Path, final: Path) -> None:
    """Make the complete checkpoint directory `complete` ROOT/step-K (`final`) and point
    `latest` at it, so that at every instant `latest` names a complete checkpoint.  A step that
    exists already is staged, then swapped in by a hard-linked copy (docs/checkpoint.md,
    "Atomic commit"); a kill at any point is finished by the next save.
    """
    staged = complete.name.startswith(_STAGED)
    if not final.exists() and not staged:
        _rename(complete, final)
        _set_latest(root, final.name)
        return
    token = uuid.uuid4().hex[:12]
    if not staged:
        complete = _rename(complete, root / f"{_STAGED}{final.name}-{token}")
    _set_latest(root, complete.name)
    aside = _rename(final, root / f"{_ASIDE}{final.name}-{token}") if final.exists() else None
    linked = root / f"{_LINKED}{final.name}-{token}"
    shutil.copytree(complete, linked, copy_function=_link_or_copy)
    _fsync_dir(linked)
    _rename(linked, final)
    _set_latest(root, final.name)
    shutil.rmtree(complete)
    if aside is not None:
        shutil.rmtree(aside)


def _finish_or_remove_interrupted_commits(root: Path) -> None:
    """Run by rank 0 before a save: a commit killed after `latest` named its staged directory
    is finished; every other directory a killed save left (.tmp-, .staged-, .old-, .link-) is
    removed, as nothing reads it."""
    try:
        live = _latest_name(root)
    except CheckpointError:
        live = None  # unreadable: this save replaces it, and nothing else is live
    if live is not None and live.startswith(_STAGED) and (root / live / "meta.json").is_file():
        target = live[len(_STAGED):].rsplit("-", 1)[0]  # ".staged-step-K-<token>" -> "step-K"
        _commit(root, root / live, root / target)
        live = target
    for entry in root.iterdir():
        if (entry.name.startswith((".tmp-", _STAGED, _ASIDE, _LINKED)) and entry.name != live
                and entry.is_dir() and not entry.is_symlink()):
            shutil.rmtree(entry)


def _rename(source: Path, target: Path) -> Path:
    os.rename(source, target)
    _fsync_dir(target.parent)
    return target


def _link_or_copy(source: str, target: str) -> None:
    """Hard link (the files of a committed checkpoint are never written again); a copy where
    the file system has no hard links."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
        _fsync_file(Path(target))


def _set_latest(root: Path, name: str) -> None:
    """Point ROOT/latest at `name` atomically: write a temporary file, fsync, os.replace."""
    latest_tmp = root / f".{LATEST}.tmp"
    latest_tmp.write_text(f"{name}\n")
    _fsync_file(latest_tmp)
    os.replace(latest_tmp, root / LATEST)
    _fsync_dir(root)


def _latest_name(root: Path) -> str | None:
    """The directory name ROOT/latest holds (None without one), refused unless it is one
    plain name of an entry inside ROOT.  `latest` itself must be a regular file (a symlink
    could lead anywhere, a FIFO would block the load) of at most a few KiB."""
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        return None
    data = _read_regular(pointer, _LATEST_MAX_BYTES, "a checkpoint's `latest`",
                         f"write the name of a step-K directory into {pointer}, or load a "
                         "step-K directory")
    try:
        name = data.decode().strip()
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{pointer} cannot be read ({err}); write the name of a "
                              "step-K directory into it, or load a step-K directory") from None
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or "\n" in name or Path(name).name != name):
        raise CheckpointError(f"{pointer} holds {name!r}, which is not the name of a directory "
                              f"inside {root}; a checkpoint's `latest` names one of its own "
                              "step-K directories: fix the file or load a step-K directory")
    return name


def resolve(path: str | os.PathLike) -> Path:
    """The committed checkpoint directory `path` names (a step-K dir, or a root's latest)."""
    path = Path(path)
    if os.path.lexists(path / "meta.json"):
        return path  # a step-K directory (load opens meta.json only as a regular file)
    pointer = path / LATEST
    name = _latest_name(path)
    if name is None:
        raise CheckpointError(f"no checkpoint at {path}: neither meta.json nor a {LATEST!r} "
                              "file; give a checkpoint root or one of its step-K directories")
    directory = path / name
    if directory.is_symlink() or directory.resolve().parent != path.resolve():
        raise CheckpointError(f"{pointer} names {name}, which leads to {directory.resolve()}, "
                              f"not a directory inside {path}; `latest` must name one of the "
                              "root's own step-K directories: load the other checkpoint by its "
                              "own path")
    if not directory.is_dir() or not os.path.lexists(directory / "meta.json"):
        raise CheckpointError(f"{pointer} names {directory.name}, which has no meta.json; "
                              "the checkpoint is incomplete: load an older step-K directory")
    return directory


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
