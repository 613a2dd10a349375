"""Verdicts and the exit codes they map to: one place for both.

A verdict is proof or nothing.  ``IDENTICAL``/``PASS`` are only ever given when every
byte that should have been compared was compared; a run that crashed, a stream that is
damaged or missing, or a window that compared nothing is ``INCOMPLETE`` (exit 2), never a
good verdict.  Members are strings, so ``result.verdict == "identical"`` and JSON output
keep working unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any, Callable, ClassVar

EXIT_OK, EXIT_BAD_VERDICT, EXIT_CANNOT_RUN = 0, 1, 2
# A step's result may come from a hardware fault (samebits.rerun: a transient fault, or a
# failed check that reproduces on this hardware): restart the job on other hardware.  The
# value Megatron's rerun state machine uses, so a scheduler can treat both alike.
EXIT_RERUN_ELSEWHERE = 16
# The live check (`samebits run --reference`, the recipe's --reference) stopped a run at its first
# step that differs from the reference run: the process, and `samebits run` around it, exit 3.
EXIT_STOPPED = 3


class Verdict(str, enum.Enum):
    """The outcome of a comparison or a check; ``exit_code`` is what the CLI returns."""

    IDENTICAL = "identical"  # every compared record equal, and something was compared
    DIVERGED = "diverged"  # a difference, with its evidence
    PASS = "pass"  # every guarantee checked held
    FAIL = "fail"  # a guarantee checked did not hold
    INCOMPLETE = "incomplete"  # could not decide: crashed run, damaged or missing data, empty window

    @property
    def exit_code(self) -> int:
        if self in (Verdict.IDENTICAL, Verdict.PASS):
            return EXIT_OK
        if self in (Verdict.DIVERGED, Verdict.FAIL):
            return EXIT_BAD_VERDICT
        return EXIT_CANNOT_RUN

    @property
    def good(self) -> bool:
        return self.exit_code == EXIT_OK

    def __str__(self) -> str:  # print the word, not "Verdict.IDENTICAL"
        return self.value


class ToDict:
    """The one serialiser: a result dataclass offers ``to_dict()``, plain JSON-ready values
    derived from its fields, in field order.

    Each value is made plain the same way: a `Verdict` (any enum) gives its value, a path its
    string, a nested result its own ``to_dict()`` (a dataclass that is not a `ToDict`, its
    fields), a tuple, list or set a list, a mapping a dict with string keys and plain values.
    The exceptions are marked, never written out by hand:

    * on a field, ``field(metadata=serialised(...))``: under another ``key``, left out
      (``skip``, or ``omit_none`` while it is None), or through ``convert`` (value -> plain);
    * on the class, ``dict_extras()``: computed entries (a property such as an exit code);
      ``dict_keys``: the keys written and their order, when they are not every field's in
      field order (a subset, an extra placed among the fields).

    ``to_json()`` was the name in four packages until 2026-12; it stays as a deprecated alias.
    """

    #: The keys ``to_dict`` writes, in this order (None: every field's, in field order, then
    #: the extras).  A key names a field (by its ``serialised(key=...)`` if renamed) or an extra.
    dict_keys: ClassVar[tuple[str, ...] | None] = None

    def dict_extras(self) -> dict:
        """Computed entries, by key (plain values, or values `plain` makes plain)."""
        return {}

    def to_dict(self) -> dict:
        if not dataclasses.is_dataclass(self):
            raise NotImplementedError(f"{type(self).__name__} is not a dataclass: define its to_dict()")
        out = {}
        for item in dataclasses.fields(self):
            how: _Serialised = item.metadata.get(_METADATA_KEY, _DEFAULT)
            value = getattr(self, item.name)
            if how.skip or (how.omit_none and value is None):
                continue
            value = how.convert(value) if how.convert is not None else plain(value)
            if how.flatten:
                out.update(value)
            else:
                out[how.key or item.name] = value
        out.update((key, plain(value)) for key, value in self.dict_extras().items())
        if self.dict_keys is None:
            return out
        return {key: out[key] for key in self.dict_keys if key in out}

    def to_json(self) -> dict:
        warnings.warn(f"{type(self).__name__}.to_json() is deprecated: use to_dict()",
                      DeprecationWarning, stacklevel=2)
        return self.to_dict()


@dataclasses.dataclass(frozen=True)
class _Serialised:
    key: str | None = None
    skip: bool = False
    omit_none: bool = False
    convert: Callable[[Any], Any] | None = None
    flatten: bool = False


_METADATA_KEY = "samebits.to_dict"
_DEFAULT = _Serialised()


def serialised(*, key: str | None = None, skip: bool = False, omit_none: bool = False,
               convert: Callable[[Any], Any] | None = None, flatten: bool = False) -> dict:
    """Field metadata saying how `ToDict.to_dict` writes a field that is an exception:
    ``field(metadata=serialised(key="id"))``.  ``key``: the name it is written under;
    ``skip``: never written; ``omit_none``: not written while None; ``convert``: the plain
    value, from the field's value (instead of `plain`); ``flatten``: the value is a mapping
    whose entries are written in the field's place (a result that extends a dict it holds)."""
    if skip and (key is not None or omit_none or convert is not None or flatten):
        raise ValueError("serialised(skip=True) takes no other option: a skipped field is never written")
    if flatten and key is not None:
        raise ValueError("serialised(flatten=True) writes the field's entries, not the field: it takes no key")
    return {_METADATA_KEY: _Serialised(key, skip, omit_none, convert, flatten)}


def plain(value: Any) -> Any:
    """``value`` as plain JSON-ready data, the way `ToDict.to_dict` writes every field."""
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if callable(getattr(value, "to_dict", None)):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {_plain_key(key): plain(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return [plain(item) for item in sorted(value, key=repr)]
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def milliseconds(seconds: Any) -> Any:
    """Seconds as results write them: rounded to the millisecond (a number, or each value of a
    mapping of them); a field's ``serialised(convert=milliseconds)``."""
    if isinstance(seconds, Mapping):
        return {_plain_key(key): round(value, 3) for key, value in seconds.items()}
    return round(seconds, 3)


def _plain_key(key: Any) -> str:
    if isinstance(key, enum.Enum):
        return str(key.value)
    return key if isinstance(key, str) else str(key)


__all__ = ["Verdict", "ToDict", "serialised", "plain", "milliseconds", "EXIT_OK", "EXIT_BAD_VERDICT", "EXIT_CANNOT_RUN",
           "EXIT_RERUN_ELSEWHERE", "EXIT_STOPPED"]
