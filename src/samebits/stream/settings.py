"""Recorder settings: arguments first, then ``SAMEBITS_*`` environment variables, then defaults.

The variables (``SAMEBITS_DIR``, ``_DISABLE``, ``_STEPS``, ``_RANKS``, ``_PHASES``,
``_MAX_TENSOR_BYTES``, ``_FLUSH_STEPS``) are declared, parsed and documented once, in
`samebits.settings` (docs/settings.md).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from samebits import settings
from samebits._torchutil import rank_and_world_size
from samebits.errors import ConfigError
from samebits.settings import parse_ranks, parse_steps  # noqa: F401  (re-exported: tracing reads windows too)


@dataclass(frozen=True)
class RecorderSettings:
    directory: Path
    rank: int
    world_size: int
    step_start: int
    step_stop: int | None
    rank_selected: bool
    max_tensor_bytes: int | None
    flush_every: int
    enabled: bool
    phases: frozenset[str] | None = None  # None: every phase
    ranks: frozenset[int] | None = None  # the ranks selected for recording; None: every rank
    include: tuple[str, ...] = ()  # globs on "phase/name" or name; empty: every tensor
    exclude: tuple[str, ...] = ()

    def selected(self, step: int, phase: str) -> bool:
        return (step >= self.step_start and (self.step_stop is None or step < self.step_stop)
                and (self.phases is None or phase in self.phases))

    @property
    def filters_names(self) -> bool:
        return bool(self.include or self.exclude)

    def name_selected(self, phase: str, name: str) -> bool:
        """Whether a tensor passes the include/exclude globs (matched on ``phase/name``, then ``name``)."""
        full = f"{phase}/{name}"

        def matches(patterns):
            return any(fnmatch.fnmatchcase(full, p) or fnmatch.fnmatchcase(name, p) for p in patterns)

        return (not self.include or matches(self.include)) and not matches(self.exclude)

    @classmethod
    def resolve(cls, *, directory, rank, world_size, steps, ranks, max_tensor_bytes, flush_every, enabled,
                phases=None, include=None, exclude=None):
        if enabled is None:
            enabled = not settings.read("SAMEBITS_DISABLE")
        if directory is None:
            directory = settings.read("SAMEBITS_DIR")
        if directory is None and enabled:
            raise ConfigError("Recorder needs a directory: pass one or set SAMEBITS_DIR.")
        default_rank, default_world = rank_and_world_size()
        try:
            rank = default_rank if rank is None else int(rank)
            world_size = default_world if world_size is None else int(world_size)
        except (TypeError, ValueError):
            raise ConfigError(f"rank={rank!r} and world_size={world_size!r} must be integers.") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}.")
        step_source = "steps" if steps is not None else "SAMEBITS_STEPS"
        start, stop = parse_steps(steps, step_source) if steps is not None else settings.read("SAMEBITS_STEPS")
        rank_source = "ranks" if ranks is not None else "SAMEBITS_RANKS"
        selected = parse_ranks(ranks, rank_source) if ranks is not None else settings.read("SAMEBITS_RANKS")
        cap_source = "max_tensor_bytes" if max_tensor_bytes is not None else "SAMEBITS_MAX_TENSOR_BYTES"
        cap = max_tensor_bytes if max_tensor_bytes is not None else settings.read("SAMEBITS_MAX_TENSOR_BYTES")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ConfigError(
                f"{cap_source}={cap!r}: the size cap is a positive number of bytes (tensors larger than it keep "
                "shape and dtype but no digest, so their values are never compared). Leave it unset to digest "
                "every tensor.")
        flush = flush_every if flush_every is not None else settings.read("SAMEBITS_FLUSH_STEPS")
        if flush < 1:
            raise ConfigError(f"flush_every must be >= 1 step, got {flush}.")
        if phases is None:
            phases = settings.read("SAMEBITS_PHASES") or None
        if isinstance(phases, str):
            phases = [p.strip() for p in phases.split(",") if p.strip()]
        include = settings.read("SAMEBITS_INCLUDE") if include is None else include
        exclude = settings.read("SAMEBITS_EXCLUDE") if exclude is None else exclude
        return cls(
            include=_patterns(include),
            exclude=_patterns(exclude),
            phases=frozenset(phases) if phases is not None else None,
            directory=Path(directory) if directory is not None else Path("."),
            rank=rank,
            world_size=world_size,
            step_start=start,
            step_stop=stop,
            rank_selected=selected is None or rank in selected,
            ranks=selected,
            max_tensor_bytes=cap,
            flush_every=flush,
            enabled=bool(enabled),
        )


def _patterns(value) -> tuple[str, ...]:
    if not value:
        return ()
    if isinstance(value, str):
        value = value.split(",")
    return tuple(p.strip() for p in value if p.strip())
