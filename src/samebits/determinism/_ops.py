"""The op catalog: ATen ops known to be nondeterministic, loaded from the checked-in
``ops.json`` (package data), with a lookup by op name for the tracer and the probe."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

from samebits.verdicts import ToDict

CPU_STATES = ("varies", "may-vary", "repeatable", "n/a")
FLAG_STATES = ("repeatable", "raises", "n/a")


@dataclass(frozen=True)
class OpEntry(ToDict):
    """One catalog row: an op under one condition (`when`); the fields' values are listed in
    docs/determinism.md, "Op catalog"."""

    id: str
    op: str
    aliases: tuple[str, ...]
    when: str
    cpu: str
    cpu_flag: str
    thread_count_changes_bits: bool | None
    cuda: str
    cuda_flag: str
    why: str
    alternative: str
    cost: str
    source: tuple[str, ...]

    @property
    def nondeterministic(self) -> bool:
        """True when the op can vary run to run on some device with default settings."""
        return self.cpu in ("varies", "may-vary") or self.cuda in ("varies", "may-vary")

    def summary(self) -> str:
        """One line for annotating a finding."""
        return (f"{self.op} ({self.when}): CPU {self.cpu}, CUDA {self.cuda}; "
                f"deterministic alternative: {self.alternative}")


@functools.lru_cache(maxsize=1)
def _catalog() -> tuple[tuple[OpEntry, ...], dict[str, tuple[OpEntry, ...]]]:
    text = resources.files("samebits.determinism").joinpath("ops.json").read_text("utf-8")
    entries: list[OpEntry] = []
    index: dict[str, list[OpEntry]] = {}
    for row in json.loads(text)["ops"]:
        entry = OpEntry(**{**row, "aliases": tuple(row.get("aliases", ())), "source": tuple(row.get("source", ()))})
        assert entry.cpu in CPU_STATES and entry.cuda in CPU_STATES, entry.id
        assert entry.cpu_flag in FLAG_STATES and entry.cuda_flag in FLAG_STATES, entry.id
        entries.append(entry)
        for name in (entry.op, *entry.aliases):
            index.setdefault(name, []).append(entry)
    return tuple(entries), {k: tuple(v) for k, v in index.items()}


def op_catalog() -> tuple[OpEntry, ...]:
    """Every catalog row, in file order."""
    return _catalog()[0]


def normalize_op_name(op: Any) -> str:
    """``aten::index_put_`` from any spelling: an OpOverload, ``aten.index_put_.default``,
    ``aten::index_put_.default`` or a bare ``index_put_`` (taken as aten)."""
    schema = getattr(op, "_schema", None)
    if schema is not None:
        return schema.name
    name = str(op)
    if "::" in name:
        namespace, rest = name.split("::", 1)
    elif "." in name:
        namespace, rest = name.split(".", 1)
    else:
        namespace, rest = "aten", name
    return f"{namespace}::{rest.split('.', 1)[0]}"


def lookup_op(op: Any) -> tuple[OpEntry, ...]:
    """The catalog rows for an op (one per condition; empty when not listed), by any spelling
    (`normalize_op_name`); aliases (``aten::index_put``) find the same rows."""
    return _catalog()[1].get(normalize_op_name(op), ())
