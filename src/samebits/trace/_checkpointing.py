"""A checkpoint library's own work is not the training: tracing leaves it out.

`torch.distributed.checkpoint` (DCP) broadcasts a fresh random ``save_id`` every save, so two
bit-identical trainings that checkpoint would differ in it (issue 33).  A collective issued
from DCP's code passes through untraced (`issued_by_checkpointing`, a walk of the caller's
frames), and DCP's entry points run inside `Tracer.suspended()` once DCP is imported (`patch`).
A save reached through a name imported before the patch runs its ops traced.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Callable

import torch

_CHECKPOINT_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed", "checkpoint") + os.sep
_ENTRY_POINTS = {
    "torch.distributed.checkpoint.state_dict_saver": ("save", "async_save", "save_state_dict"),
    "torch.distributed.checkpoint.state_dict_loader": ("load", "load_state_dict"),
}
_PACKAGE = "torch.distributed.checkpoint"
_originals: dict[tuple[str, str], Callable] = {}


def issued_by_checkpointing(frame=None) -> bool:
    """Whether the caller (``frame``, default: the caller's) runs inside DCP's code."""
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_CHECKPOINT_DIR):
            return True
        frame = frame.f_back
    return False


def _untraced(original: Callable, active: Callable) -> Callable:
    @functools.wraps(original)
    def untraced(*args, **kwargs):
        tracer = active()
        if tracer is None:
            return original(*args, **kwargs)
        with tracer.suspended():  # the library's work: never traced, never counted
            return original(*args, **kwargs)

    untraced._samebits_original = original
    return untraced


def patch(active: Callable) -> None:
    """Run DCP's entry points untraced, once DCP is imported; ``active()`` gives the tracer."""
    if _originals or _PACKAGE not in sys.modules:
        return
    package = sys.modules[_PACKAGE]
    for module_name, names in _ENTRY_POINTS.items():
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            original = getattr(module, name, None)
            if original is None or hasattr(original, "_samebits_original"):
                continue
            _originals[(module_name, name)] = original
            wrapper = _untraced(original, active)
            setattr(module, name, wrapper)
            if getattr(package, name, None) is original:
                setattr(package, name, wrapper)


def unpatch() -> None:
    """Give DCP its entry points back."""
    package = sys.modules.get(_PACKAGE)
    for (module_name, name), original in _originals.items():
        module = sys.modules.get(module_name)
        if module is not None and getattr(getattr(module, name, None), "_samebits_original", None) is original:
            setattr(module, name, original)
        if package is not None and getattr(getattr(package, name, None), "_samebits_original", None) is original:
            setattr(package, name, original)
    _originals.clear()
