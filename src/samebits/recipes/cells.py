"""The recipe's parallel layout: its sizes (`ParallelDims`) and their one-word names (cells).

A cell is ``-``-joined parallel sizes, each at most once: ``dpN`` plain data parallel
(experts replicated), ``fsdpN`` FSDP2 sharding, ``tpN`` tensor parallel, ``ppN`` pipeline
stages, ``epN`` expert parallel over N data-parallel replicas (implies ``dpN``); or
``single`` (one rank).  Every size not named is 1, so a cell fixes the whole layout.  The
sizes are the recipe's config fields (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``,
``ep``): the recipe's ``--cell`` reads this grammar, and `samebits matrix` (through
`samebits.recipes.commands`) passes a cell to the recipe as those ``--set`` overrides.

    parse_cell("tp2-dp2")                 # {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 2, "ep": 1}
    dims = ParallelDims.parse("tp2-dp2")  # world_size 4, dp 2, name "tp2-dp2"
    dims.overrides()                      # ["pp=1", "dp_replicate=2", "dp_shard=1", "tp=2", "ep=1"]
    cell_name(dims)                       # "tp2-dp2": the canonical name

This module loads no torch: the command line reads cells without starting the library.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Mapping

from samebits.errors import ConfigError

if TYPE_CHECKING:  # the config module loads torch (its precisions)
    from samebits.recipes.config import RecipeConfig

SIZE_NAMES = ("pp", "dp_replicate", "dp_shard", "tp", "ep")  # config fields, in override order
_PART = re.compile(r"(dp|fsdp|tp|pp|ep)([1-9]\d*)")
_FIELD = {"dp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp", "ep": "ep"}


@dataclass(frozen=True)
class ParallelDims:
    """Resolved mesh sizes: world size = pp * dp_replicate * dp_shard * tp; ep is 1 or
    dp_replicate (experts sharded over the replicas)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def parse(cls, name: str) -> ParallelDims:
        """The layout a cell name fixes (`parse_cell`'s sizes)."""
        return cls(**parse_cell(name))

    @classmethod
    def resolve(cls, cfg: RecipeConfig, world_size: int) -> ParallelDims:
        """The sizes `cfg` asks for on `world_size` ranks, or a ConfigError saying why not."""
        fixed = cfg.pp * cfg.dp_shard * cfg.tp
        replicate = cfg.dp_replicate or max(1, world_size // fixed)
        dims = cls(cfg.pp, replicate, cfg.dp_shard, cfg.tp,
                   replicate if cfg.ep == 0 else cfg.ep)
        if dims.world_size != world_size:
            raise ConfigError(
                f"the parallel layout {dims.name} (pp={dims.pp} x dp_replicate="
                f"{dims.dp_replicate} x dp_shard={dims.dp_shard} x tp={dims.tp} = "
                f"{dims.world_size} ranks) does not fit world size {world_size}; launch "
                f"{dims.world_size} ranks or change the sizes (dp_replicate=0 takes what is left)")
        if dims.ep not in (1, dims.dp_replicate):
            raise ConfigError(f"ep={dims.ep} must be 1 or dp_replicate={dims.dp_replicate}")
        if dims.ep > 1 and cfg.num_experts % dims.ep:
            raise ConfigError(f"num_experts={cfg.num_experts} is not divisible by the "
                              f"expert-parallel size {dims.ep}; choose a multiple")
        if dims.dp_shard > 1 and dims.dp_replicate > 1:
            raise ConfigError("dp_shard > 1 with dp_replicate > 1 (HSDP) is not offered by the "
                              "recipe; use one of them")
        if dims.pp > 1 and (dims.dp_shard > 1 or dims.ep > 1):
            raise ConfigError("pp > 1 runs with plain DP (dp_replicate) and TP only; set "
                              "dp_shard=1 and ep=1")
        if cfg.fault_ep_dispatch_order and dims.ep < 2:
            raise ConfigError("fault_ep_dispatch_order plants a fault in the EP dispatcher: "
                              "needs ep >= 2 (e.g. cell ep2)")
        return dims

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches a step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def name(self) -> str:
        return cell_name(self)

    def sizes(self) -> dict[str, int]:
        return asdict(self)

    def overrides(self) -> list[str]:
        """The recipe's ``--set`` overrides that fix this layout ("key=value", every size)."""
        return [f"{key}={value}" for key, value in self.sizes().items()]

    def coords(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of `rank` (row-major over pp, dp_replicate, dp_shard, tp), plus dp and ep indices."""
        rest, tp = divmod(rank, self.tp)
        rest, shard = divmod(rest, self.dp_shard)
        pp, replicate = divmod(rest, self.dp_replicate)
        return {"pp": pp, "dp_replicate": replicate, "dp_shard": shard, "tp": tp,
                "dp": replicate * self.dp_shard + shard,
                "ep": replicate if self.ep > 1 else 0}


def parse_cell(name: str) -> dict[str, int]:
    """Config overrides of a cell name such as "tp2-dp2", "fsdp2-tp2", "pp2", "ep2", "dp4"
    ("single": every size 1): dpN = plain data parallel (experts replicated, ep=1), fsdpN =
    FSDP2 sharding, tpN, ppN, epN = expert parallel over N data-parallel replicas (implies
    dpN).  Every size not named is 1, so a cell fixes the whole layout.

    A bad name is a ConfigError saying which part is wrong and what the grammar allows."""
    text = name.strip().lower()
    values: dict[str, int] = {}
    if text != "single":
        for part in text.split("-") if text else []:
            match = _PART.fullmatch(part)
            if match is None or _FIELD[match.group(1)] in values:
                raise ConfigError(f"cell {name!r}: {part!r} is not one of dpN, fsdpN, tpN, ppN, epN (each at most "
                                  "once, joined by '-'), e.g. tp2-dp2; or 'single' for one rank")
            values[_FIELD[match.group(1)]] = int(match.group(2))
        if not values:
            raise ConfigError(f"cell {name!r} names no parallel size; e.g. single, dp2, fsdp2, tp2-dp2")
    if "ep" in values and values.setdefault("dp_replicate", values["ep"]) != values["ep"]:
        raise ConfigError(f"cell {name!r}: epN runs over the data-parallel replicas, so N must equal dp's size "
                          f"({values['dp_replicate']})")
    return {key: values.get(key, 1) for key in SIZE_NAMES}


_PRODUCT_KEY = {"dp": "dp_replicate", "fsdp": "dp_shard", "tp": "tp", "pp": "pp", "ep": "ep"}


def parse_layouts(spec: str) -> list[ParallelDims]:
    """The layouts of ``verify --across``: a comma-separated list of cells (``"single,dp2,tp2"``)
    or the product of sizes (``"dp=1,2 tp=1,2"``: every combination, in that order; ``dp=1,2,4``
    alone is three DP sizes).  At least two distinct layouts; a bad spec is a ConfigError
    showing both forms."""
    text = " ".join((spec or "").split())
    forms = "give cells in the cell grammar (single,dp2,tp2,fsdp2) or sizes to multiply (dp=1,2,4 tp=1,2)"
    if not text:
        raise ConfigError(f"--across: no layouts; {forms}")
    if "=" in text:
        axes = []
        for word in text.split(" "):
            key, _, values = word.partition("=")
            sizes = values.split(",")
            if key not in _PRODUCT_KEY or not all(v.isdigit() and int(v) >= 1 for v in sizes):
                raise ConfigError(f"--across {spec!r}: {word!r} is not KEY=N,N,... with KEY one of dp, fsdp, tp, pp, "
                                  f"ep and positive sizes; {forms}")
            if any(key == other for other, _ in axes):
                raise ConfigError(f"--across {spec!r}: {key} is given twice; {forms}")
            axes.append((key, [int(v) for v in sizes]))
        layouts = []
        for combination in itertools.product(*(values for _, values in axes)):
            parts = [f"{name}{size}" for (name, _), size in zip(axes, combination) if size > 1]
            dims = ParallelDims.parse("-".join(parts) or "single")
            if dims not in layouts:  # ep=N implies dp=N: (dp=1, ep=2) and (dp=2, ep=2) are one layout
                layouts.append(dims)
    else:
        layouts = [ParallelDims.parse(word) for word in text.replace(" ", ",").split(",") if word]
    names = [dims.name for dims in layouts]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"--across {spec!r}: {duplicates[0]} is given twice (each layout runs once)")
    if len(layouts) < 2:
        raise ConfigError(f"--across {spec!r}: give at least two layouts to compare; {forms}")
    return layouts


def cell_name(sizes: ParallelDims | Mapping[str, int]) -> str:
    """The canonical name of a layout ("single" for one rank): pp, tp, fsdp, then ep (which
    implies dp) or dp."""
    if isinstance(sizes, ParallelDims):
        sizes = sizes.sizes()

    def size(key: str) -> int:
        return int(sizes.get(key, 1))

    parts = [f"pp{size('pp')}" if size("pp") > 1 else "", f"tp{size('tp')}" if size("tp") > 1 else "",
             f"fsdp{size('dp_shard')}" if size("dp_shard") > 1 else ""]
    if size("ep") > 1:
        parts.append(f"ep{size('ep')}")
    elif size("dp_replicate") > 1:
        parts.append(f"dp{size('dp_replicate')}")
    return "-".join(p for p in parts if p) or "single"


__all__ = ["ParallelDims", "parse_cell", "parse_layouts", "cell_name", "SIZE_NAMES"]
