"""The recipe's parallel layout: its axes (`AXES`, the one table), its sizes (`ParallelDims`)
and their one-word names (cells: ``tp2-dp2``, ``single``; docs/matrix.md).

Everything that names the axes reads `AXES`: the grammar, the mesh (`parallelize.py`), the
rank coordinates and `verify --across`, which sets each split axis's layout-invariant switch
or refuses it.  This module loads no torch: the command line reads cells without the library.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Mapping

from samebits.errors import ConfigError

if TYPE_CHECKING:  # the config module loads torch (its precisions)
    from samebits.recipes.config import RecipeConfig


@dataclass(frozen=True)
class Axis:
    """One parallel axis of the recipe."""

    word: str  # its word in a cell name: "tp" of "tp2-dp2"
    field: str  # the config field (and `ParallelDims` field) it sizes
    mesh: int | None  # its dimension of the device mesh, outermost 0; None: it runs over `over`'s ranks
    name_order: int  # its place in the canonical cell name
    coordinate: str  # a rank's coordinate it counts in (seed rule, stream header): both DP kinds count in "dp"
    switch: str | None = None  # the setting that makes its reductions layout-invariant (`verify --across`)
    covers: str = ""  # what the switch makes invariant (the certificate lists it)
    refusal: str | None = None  # why `verify --across` refuses a layout that splits it (no switch yet)
    over: str | None = None  # the field whose ranks it runs over: its size is that one's, its index too


# The one table of axes, in the order `verify --across` lists their switches (docs/invariance.md,
# "The reductions of the recipe's step", details each reduction).  Whether the recipe accepts a
# combination is its own config's call (`--check`), never decided here.
AXES: tuple[Axis, ...] = (
    Axis("dp", "dp_replicate", mesh=1, name_order=4, coordinate="dp", switch="grad_reduce=invariant",
         covers="the data-parallel gradient reduction and the clipping norm: per-micro-batch gradients summed in "
                "int64 fixed point (samebits.invariant)"),
    Axis("fsdp", "dp_shard", mesh=2, name_order=2, coordinate="dp", switch="grad_reduce=invariant",
         covers="the FSDP2 gradient reduce-scatter: the same int64 fixed point"),
    Axis("tp", "tp", mesh=3, name_order=1, coordinate="tp", switch="tp_reduce=invariant",
         covers="the tensor-parallel linears forward and backward, the norms' weight gradients under sequence "
                "parallelism and the clipping norm: exact block products summed in int64"),
    Axis("pp", "pp", mesh=0, name_order=0, coordinate="pp", switch="grad_reduce=invariant",
         covers="the pipeline's micro-batch gradient accumulation (int64 fixed point), each block's random draws "
                "keyed by (step, micro-batch, block) and the clipping norm over the stages"),
    Axis("ep", "ep", mesh=None, name_order=3, coordinate="ep", over="dp_replicate", switch="grad_reduce=invariant",
         covers="the experts' weight gradients: each (expert, source rank) segment its own GEMM, its gradient one "
                "micro-batch's, summed on the owner in int64; the clipping norm over the EP group"),
)


def mesh_axes() -> list[Axis]:
    """The axes that are dimensions of the device mesh, outermost first."""
    return sorted((axis for axis in AXES if axis.mesh is not None), key=lambda axis: axis.mesh)


@dataclass(frozen=True)
class ParallelDims:
    """Resolved sizes, one per axis of `AXES`: world size = the product of the mesh axes; ep is 1
    or dp_replicate (experts sharded over the replicas)."""

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
            product = " x ".join(f"{axis.field}={dims.size(axis)}" for axis in mesh_axes())
            raise ConfigError(
                f"the parallel layout {dims.name} ({product} = {dims.world_size} ranks) does not fit world size "
                f"{world_size}; launch {dims.world_size} ranks or change the sizes (dp_replicate=0 takes what is "
                "left)")
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

    def size(self, axis: Axis) -> int:
        return getattr(self, axis.field)

    @property
    def world_size(self) -> int:
        return math.prod(self.size(axis) for axis in mesh_axes())

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches a step reads."""
        return math.prod(self.size(axis) for axis in mesh_axes() if axis.coordinate == "dp")

    @property
    def name(self) -> str:
        return cell_name(self)

    def sizes(self) -> dict[str, int]:
        return asdict(self)

    def mesh_shape(self) -> tuple[int, ...]:
        """The device mesh's sizes, outermost first (`mesh_axes`; size-1 dimensions included)."""
        return tuple(self.size(axis) for axis in mesh_axes())

    def overrides(self) -> list[str]:
        """The recipe's ``--set`` overrides that fix this layout ("key=value", every size)."""
        return [f"{key}={value}" for key, value in self.sizes().items()]

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index on each axis by config field (row-major over the mesh; an axis run over
        another's ranks has that one's index where it splits, else 0), plus its `coordinates`."""
        index: dict[str, int] = {}
        for axis in reversed(mesh_axes()):
            rank, index[axis.field] = divmod(rank, self.size(axis))
        named: dict[str, int] = {}
        for axis in sorted(AXES, key=lambda axis: len(AXES) if axis.mesh is None else axis.mesh):
            if axis.over is not None:
                index[axis.field] = named[axis.coordinate] = index[axis.over] if self.size(axis) > 1 else 0
            else:  # the axes counting in one coordinate combine row-major (dp = replica * dp_shard + shard)
                named[axis.coordinate] = named.get(axis.coordinate, 0) * self.size(axis) + index[axis.field]
        return {**index, **named}

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinates ("dp", "tp", "pp", "ep"), for the seed rule and the stream header."""
        coords = self.coords(rank)
        return {axis.coordinate: coords[axis.coordinate] for axis in AXES}


def parse_cell(name: str) -> dict[str, int]:
    """Config overrides of a cell name ("tp2-dp2", "fsdp2-tp2", "ep2": expert parallel over dp2;
    "single": every size 1); every size not named is 1, so a cell fixes the whole layout.  A bad
    name is a ConfigError saying which part is wrong and what the grammar allows."""
    text = name.strip().lower()
    by_word = {axis.word: axis for axis in AXES}
    part_re = re.compile(f"({'|'.join(by_word)})([1-9]\\d*)")
    values: dict[str, int] = {}
    if text != "single":
        for part in text.split("-") if text else []:
            match = part_re.fullmatch(part)
            if match is None or by_word[match.group(1)].field in values:
                raise ConfigError(f"cell {name!r}: {part!r} is not one of {', '.join(f'{axis.word}N' for axis in AXES)} (each at most once, joined "
                                  "by '-'), e.g. tp2-dp2; or 'single' for one rank")
            values[by_word[match.group(1)].field] = int(match.group(2))
        if not values:
            raise ConfigError(f"cell {name!r} names no parallel size; e.g. single, dp2, fsdp2, tp2-dp2")
    for axis in AXES:  # an axis run over another's ranks sets that one's size (ep2 is ep2 over dp2)
        if axis.over is not None and axis.field in values \
                and values.setdefault(axis.over, values[axis.field]) != values[axis.field]:
            over = next(other.word for other in AXES if other.field == axis.over)
            raise ConfigError(f"cell {name!r}: {axis.word}N runs over the {over} ranks, so N must equal {over}'s "
                              f"size ({values[axis.over]})")
    return {field.name: values.get(field.name, 1) for field in fields(ParallelDims)}


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
        words = [axis.word for axis in AXES]
        axes = []
        for word in text.split(" "):
            key, _, values = word.partition("=")
            sizes = values.split(",")
            if key not in words or not all(v.isdigit() and int(v) >= 1 for v in sizes):
                raise ConfigError(f"--across {spec!r}: {word!r} is not KEY=N,N,... with KEY one of {', '.join(words)} "
                                  f"and positive sizes; {forms}")
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
    """The canonical name of a layout ("single" for one rank): its split axes in `name_order`,
    an axis that another one runs over left out (ep2 is ep2 over dp2)."""
    if isinstance(sizes, ParallelDims):
        sizes = sizes.sizes()
    split = {axis.field: int(sizes.get(axis.field, 1)) for axis in AXES if int(sizes.get(axis.field, 1)) > 1}
    implied = {axis.over for axis in AXES if axis.over is not None and axis.field in split}
    return "-".join(f"{axis.word}{split[axis.field]}" for axis in sorted(AXES, key=lambda axis: axis.name_order)
                    if axis.field in split and axis.field not in implied) or "single"


__all__ = ["Axis", "AXES", "ParallelDims", "mesh_axes", "parse_cell", "parse_layouts", "cell_name"]
