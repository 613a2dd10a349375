"""Torch helpers that tracing, zero-code recording, the probe and the digest share, each defined once.

Foundation layer: imports torch and, of samebits, only `errors`, so every package may use it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import os
import sys
import sysconfig
from collections.abc import Mapping
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from samebits.errors import ConfigError

TORCH_DIR = os.path.dirname(torch.__file__)
SAMEBITS_DIR = os.path.dirname(os.path.abspath(__file__))  # src/samebits

# -- tensor leaves ---------------------------------------------------------------------------


def _key_label(key) -> str:
    if isinstance(key, pytree.SequenceKey):
        return str(key.idx)
    if isinstance(key, pytree.MappingKey):
        return str(key.key)
    if isinstance(key, pytree.GetAttrKey):
        return key.name
    return str(key)


def _own_walk(x) -> bool:
    """Mappings of other types (HF ``ModelOutput``) are walked here, by key: a type pytree
    knows without key paths would make `tree_flatten_with_path` raise."""
    return isinstance(x, Mapping) and type(x) not in _PLAIN_MAPPINGS


_PLAIN_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict)


def tensor_leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(label, tensor) for every tensor in ``value`` (whatever `torch.utils._pytree` knows, other
    mappings by key, dataclasses by field); labels are dotted paths under ``prefix``."""
    for path, leaf in pytree.tree_flatten_with_path(value, is_leaf=_own_walk)[0]:
        label = ".".join([prefix] * bool(prefix) + [_key_label(k) for k in path])
        if isinstance(leaf, torch.Tensor):
            yield label, leaf
        elif isinstance(leaf, Mapping):
            for key, item in leaf.items():
                yield from tensor_leaves(item, f"{label}.{key}" if label else str(key))
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for field in dataclasses.fields(leaf):
                yield from tensor_leaves(getattr(leaf, field.name), f"{label}.{field.name}" if label else field.name)


def op_tensor_args(args: tuple, kwargs: dict) -> list[tuple[str, torch.Tensor]]:
    """(label, tensor) of an ATen op's arguments (``"1.2"``: a list's third tensor).  A plain loop
    (schemas nest one list deep): it runs for every traced op, and `tensor_leaves` measured
    about 20x slower (37 us against 1.8 us for three arguments)."""
    flat = []
    for key, a in itertools.chain(enumerate(args), kwargs.items()):
        if isinstance(a, torch.Tensor):
            flat.append((str(key), a))
        elif isinstance(a, (list, tuple)):
            flat += [(f"{key}.{j}", b) for j, b in enumerate(a) if isinstance(b, torch.Tensor)]
    return flat


def op_tensor_outputs(out: Any) -> list[tuple[str, torch.Tensor]]:
    """(label, tensor) of an ATen op's result (a tensor, or a tuple/list of them)."""
    if isinstance(out, torch.Tensor):
        return [("0", out)]
    if isinstance(out, (list, tuple)):
        return [(str(j), o) for j, o in enumerate(out) if isinstance(o, torch.Tensor)]
    return []


# -- bits ------------------------------------------------------------------------------------

#: The integer dtype of each element size.  A tensor viewed as it keeps its bits: a copy is a plain
#: bit copy (also for dtypes without a copy kernel of their own, torch.uint4 and other shell dtypes)
#: and equality is bitwise (-0.0 differs from 0.0, a NaN equals its own bits).
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as the integer dtype of its element size (uint8, int16, int32, int64), or ``t``
    itself where there is none (complex128).  The digest's non-contiguous path calls it: keep it a
    lookup and a view."""
    int_dtype = _INT_OF_SIZE.get(t.dtype.itemsize)
    return t if int_dtype is None else t.view(int_dtype)


def ordered_bits(bits, width: int):
    """A float's ``width``-bit pattern as an integer that counts representable values from zero,
    one per ulp (-0.0 and +0.0 are both 0, the smallest subnormals -1 and 1): two floats' distance
    in ulps is the difference.  ``bits``: a Python int or an int64 tensor, the pattern read signed
    or unsigned (any bit above the magnitude is the sign)."""
    magnitude = bits & ((1 << (width - 1)) - 1)
    if isinstance(bits, torch.Tensor):
        return torch.where(bits != magnitude, -magnitude, magnitude)
    return -magnitude if bits != magnitude else magnitude


# -- call sites ------------------------------------------------------------------------------


def call_site(skip_frames: int = 1, *, skip: tuple[str, ...] = ("<",), with_function: bool = True) -> str | None:
    """``file:line in function`` (or ``file:line``) of the innermost caller that is the
    program's: not torch's own folder (torchtitan is the program's), not the standard library
    (``runpy``, ``contextlib``), and starting with none of ``skip``."""
    frame = sys._getframe(skip_frames)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and not _library_file(filename):
            if with_function:
                return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


_STDLIB_DIRS = tuple({os.path.join(sysconfig.get_paths()[key], "") for key in ("stdlib", "platstdlib")})
_PACKAGE_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


@functools.lru_cache(maxsize=4096)
def _library_file(filename: str) -> bool:
    """A file of torch itself or of the standard library (not site-packages: programs' code)."""
    if filename.startswith(TORCH_DIR + os.sep):
        return True
    return filename.startswith(_STDLIB_DIRS) and not any(part in filename for part in _PACKAGE_DIRS)


# -- ops whose outputs are not results -------------------------------------------------------

#: Outputs of these ops are uninitialised memory: their bytes differ between runs by design.
UNINITIALIZED_PREFIXES = ("aten::empty", "aten::new_empty", "aten::_empty")
UNINITIALIZED_NAMES = frozenset({"aten::resize_", "aten::resize_as_", "aten::_resize_output_", "aten::set_"})


def is_uninitialized_op(name: str) -> bool:
    """True for the schema names whose outputs are uninitialised memory (above)."""
    return name.startswith(UNINITIALIZED_PREFIXES) or name in UNINITIALIZED_NAMES


# -- samebits' own torch work ----------------------------------------------------------------


def outside_dispatch_modes():
    """``with outside_dispatch_modes():`` samebits' own torch work (a census): every dispatch
    mode in force is popped meanwhile, so none sees it, counts it or shifts an op id for it."""
    return _disable_current_modes()


# -- module scope in backward ----------------------------------------------------------------

_get_sequence_nr = torch._C._autograd._get_sequence_nr
_current_node = torch._C._current_autograd_node


class AutogradScopes:
    """Which forward code created each autograd node, to name a backward op after its forward.
    Call `created` right after each forward op (its node, if any, has sequence number
    ``_get_sequence_nr() - 1``); `running` looks up the node the engine runs now."""

    __slots__ = ("_by_sequence",)

    def __init__(self):
        self._by_sequence: dict[int, Any] = {}

    def clear(self) -> None:
        self._by_sequence.clear()

    def created(self, scope: Any) -> None:
        seq = _get_sequence_nr()
        if seq:
            self._by_sequence.setdefault(seq - 1, scope)

    def running(self) -> Any:
        """What `created` stored for the autograd node being run, or None."""
        node = _current_node()
        return None if node is None else self._by_sequence.get(node._sequence_nr())


# -- optimizers ------------------------------------------------------------------------------


def optimizer_params(optimizer, names: dict[int, str]) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) in the optimizer's order; an unnamed one is ``group{g}.param{i}``."""
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            yield names.get(id(param), f"group{g}.param{i}"), param


# -- ranks -----------------------------------------------------------------------------------


def _distributed_rank_world(group=None) -> tuple[int, int] | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(group), dist.get_world_size(group)
    except Exception:
        pass
    return None


def _launcher_int(name: str) -> int | None:
    """The launcher's ``RANK``/``WORLD_SIZE``; None when unset.  A value that is not a whole
    number is refused: taking it for rank 0 would write rank 0's stream twice."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"{name}={value!r} in the environment is not a whole number: it is the launcher's "
                          f"{'rank of this process' if name == 'RANK' else 'number of processes'} "
                          "(torchrun sets it); unset it or set it to a number.")
    return int(value)


def process_rank() -> int | None:
    """This process's rank: torch.distributed's, else the launcher's ``RANK``, else None."""
    found = _distributed_rank_world()
    return found[0] if found is not None else _launcher_int("RANK")


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size): torch.distributed's, else ``RANK``/``WORLD_SIZE``, else (0, 1)."""
    found = _distributed_rank_world()
    if found is not None:
        return found
    rank, world = _launcher_int("RANK"), _launcher_int("WORLD_SIZE")
    return (0 if rank is None else rank), (1 if world is None else world)


def group_rank_and_world_size(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group`` once torch.distributed has one, else (0, 1), whatever the
    launcher says: for code that runs collectives, which need the group."""
    found = _distributed_rank_world(group)
    return found if found is not None else (0, 1)
