"""One helper for a package that imports its public names on first use (PEP 562), so that
importing the package loads none of its heavy modules (torch) until a name is used."""

from __future__ import annotations

import importlib
from typing import Callable


def lazy_exports(package: str, table: dict[str, str | tuple[str, str]], namespace: dict,
                 load_first: str | None = None) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a name to the submodule that
    defines it (``"_digest"``), or to ``(submodule, attribute)`` where the name differs; a name
    is imported once and kept in ``namespace`` (the package's globals), so later uses cost a dict
    lookup.  ``load_first`` is a module imported before any name is: one whose import registers
    something the names rely on (``samebits.kernels`` adds the CUDA digest)."""

    def __getattr__(name: str):
        where = table.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if load_first is not None:
            importlib.import_module(load_first)
        module, attribute = (where, name) if isinstance(where, str) else where
        value = getattr(importlib.import_module(f"{package}.{module}"), attribute)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
