"""The cell grammar: a parallel layout named in one word, ``tp2-dp2``, and back.

A cell is ``-``-joined parallel sizes, each at most once: ``dpN`` plain data parallel
(experts replicated), ``fsdpN`` FSDP2 sharding, ``tpN`` tensor parallel, ``ppN`` pipeline
stages, ``epN`` expert parallel over N data-parallel replicas (implies ``dpN``); or
``single`` (one rank).  Every size not named is 1, so a cell fixes the whole layout.  The
sizes are the recipe's config fields (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``,
``ep``): `samebits matrix` passes them as ``--set`` overrides, and the reference recipe
reads its ``--cell`` through this same grammar.

    cell = parse_cell("tp2-dp2")   # Cell("tp2-dp2", world_size=4, sizes={..., "tp": 2, ...})
    cell_name(cell.sizes)          # "tp2-dp2": the canonical name
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from samebits.errors import ConfigError

SIZE_NAMES = ("pp", "dp_replicate", "dp_shard", "tp", "ep")  # config fields, in override order
_PART = re.compile(r"(dp|fsdp|tp|pp|ep)([1-9]\d*)")
_FIELD = {"dp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp", "ep": "ep"}


@dataclass(frozen=True)
class Cell:
    """One parallel layout: its name, world size and the config overrides it sets."""

    name: str
    world_size: int
    overrides: tuple[str, ...]  # "key=value" for every size (none for "single")
    data_parallel: int = 1  # ranks that read different samples (dp_replicate * dp_shard)

    @property
    def sizes(self) -> dict[str, int]:
        """Every size of the layout, by config field ({"pp": 1, ..., "ep": 1} for "single")."""
        values = dict(item.split("=") for item in self.overrides)
        return {key: int(values.get(key, 1)) for key in SIZE_NAMES}


def parse_cell(name: str) -> Cell:
    """``"tp2-dp2"`` -> Cell(world_size=4, overrides=(pp=1, dp_replicate=2, dp_shard=1, tp=2, ep=1)).

    A bad name is a ConfigError saying which part is wrong and what the grammar allows."""
    text = name.strip().lower()
    if text == "single":
        return Cell("single", 1, ())
    values: dict[str, int] = {}
    for part in text.split("-") if text else []:
        match = _PART.fullmatch(part)
        if match is None or _FIELD[match.group(1)] in values:
            raise ConfigError(f"cell {name!r}: {part!r} is not one of dpN, fsdpN, tpN, ppN, epN (each at most once, "
                              "joined by '-'), e.g. tp2-dp2; or 'single' for one rank")
        values[_FIELD[match.group(1)]] = int(match.group(2))
    if not values:
        raise ConfigError(f"cell {name!r} names no parallel size; e.g. single, dp2, fsdp2, tp2-dp2")
    if "ep" in values and values.setdefault("dp_replicate", values["ep"]) != values["ep"]:
        raise ConfigError(f"cell {name!r}: epN runs over the data-parallel replicas, so N must equal dp's size "
                          f"({values['dp_replicate']})")
    sizes = {key: values.get(key, 1) for key in SIZE_NAMES}
    world = sizes["pp"] * sizes["dp_replicate"] * sizes["dp_shard"] * sizes["tp"]
    return Cell(text, world, tuple(f"{key}={value}" for key, value in sizes.items()),
                sizes["dp_replicate"] * sizes["dp_shard"])


def cell_name(sizes: Mapping[str, int]) -> str:
    """The canonical name of a layout given by its sizes ("single" for one rank): pp, tp,
    fsdp, then ep (which implies dp) or dp."""
    def size(key: str) -> int:
        return int(sizes.get(key, 1))

    parts = [f"pp{size('pp')}" if size("pp") > 1 else "", f"tp{size('tp')}" if size("tp") > 1 else "",
             f"fsdp{size('dp_shard')}" if size("dp_shard") > 1 else ""]
    if size("ep") > 1:
        parts.append(f"ep{size('ep')}")
    elif size("dp_replicate") > 1:
        parts.append(f"dp{size('dp_replicate')}")
    return "-".join(p for p in parts if p) or "single"


__all__ = ["Cell", "parse_cell", "cell_name", "SIZE_NAMES"]
