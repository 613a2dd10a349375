"""Recorder settings: arguments first, then ``SAMEBITS_*`` environment variables, then defaults.
What to record is a `samebits.settings.RecordingSpec`; every variable is in docs/settings.md.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path

from samebits import settings
from samebits._torchutil import rank_and_world_size
from samebits.errors import ConfigError
from samebits.settings import RecordingSpec


@dataclass(frozen=True)
class RecorderSettings:
    """A Recorder's resolved settings: its `RecordingSpec` (``spec``), and the spec's values the
    hot path reads, as plain attributes."""

    directory: Path
    rank: int
    world_size: int
    spec: RecordingSpec
    flush_every: int
    enabled: bool
    step_start: int
    step_stop: int | None
    rank_selected: bool
    max_tensor_bytes: int | None
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
    def resolve(cls, *, directory, rank, world_size, flush_every, enabled, spec: RecordingSpec | None = None,
                **what) -> "RecorderSettings":
        """``what``: `RecordingSpec` fields given as arguments (None: not given); they override
        ``spec``, which is read from the environment when not given."""
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
        if spec is not None and not isinstance(spec, RecordingSpec):
            raise ConfigError(f"spec={spec!r} is a {type(spec).__name__}; pass a samebits.RecordingSpec "
                              "(or the keywords steps=, ranks=, phases=, include=, exclude=, max_tensor_bytes=).")
        spec = (RecordingSpec.from_env() if spec is None else spec).replace(**what)
        flush = flush_every if flush_every is not None else settings.read("SAMEBITS_FLUSH_STEPS")
        if flush < 1:
            raise ConfigError(f"flush_every must be >= 1 step, got {flush}.")
        start, stop = spec.steps
        return cls(
            directory=Path(directory) if directory is not None else Path("."),
            rank=rank,
            world_size=world_size,
            spec=spec,
            flush_every=flush,
            enabled=bool(enabled),
            step_start=start,
            step_stop=stop,
            rank_selected=spec.ranks is None or rank in spec.ranks,
            max_tensor_bytes=spec.max_tensor_bytes,
            phases=spec.phases,
            ranks=spec.ranks,
            include=spec.include,
            exclude=spec.exclude,
        )
