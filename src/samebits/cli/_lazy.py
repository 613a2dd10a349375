"""Library names the command line loads only when a command runs, not to build its parser.

``diff, DiffResult = lazy("samebits.compare", "diff", "DiffResult")`` at module level: the
module is imported at first use (the library imports torch, about two seconds; ``--help``
needs none of it).  tests/test_architecture.py reads ``lazy(...)`` calls as imports.
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyName:
    """A name of a module, imported on first use."""

    __slots__ = ("_module", "_name", "_value")

    def __init__(self, module: str, name: str) -> None:
        self._module, self._name, self._value = module, name, None

    def resolve(self) -> Any:
        if self._value is None:
            self._value = getattr(importlib.import_module(self._module), self._name)
        return self._value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.resolve(), attribute)

    def __instancecheck__(self, instance: Any) -> bool:  # isinstance(x, LazyName of a class)
        return isinstance(instance, self.resolve())

    def __repr__(self) -> str:
        return f"lazy({self._module!r}, {self._name!r})"


def lazy(module: str, *names: str) -> Any:
    """``names`` of ``module`` (one `LazyName`, or a tuple of them), imported on first use."""
    if not names:
        raise TypeError("lazy(module, name, ...): name at least one name of the module")
    found = tuple(LazyName(module, name) for name in names)
    return found[0] if len(found) == 1 else found
