"""Recorder settings: arguments first, then ``SAMEBITS_*`` environment variables, then defaults.

=============================  ==========================================================
``SAMEBITS_DIR``               where streams go (the Recorder's ``directory``)
``SAMEBITS_DISABLE=1``         turn recording off (zero cost)
``SAMEBITS_STEPS=START:STOP``  record only steps START <= step < STOP (either may be empty)
``SAMEBITS_RANKS=0,2,4-7``     record only these ranks
``SAMEBITS_PHASES=grads,params`` record only these phases (default: all)
``SAMEBITS_MAX_TENSOR_BYTES``  tensors larger than this keep shape/dtype but no digest
``SAMEBITS_FLUSH_STEPS``       write to the OS at least every N steps (default 1)
=============================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from samebits.errors import ConfigError


def parse_steps(spec: str | range | None, source: str) -> tuple[int, int | None]:
    if spec is None or spec == "":
        return 0, None
    if isinstance(spec, range):
        if spec.step != 1:
            raise ConfigError(f"{source}: a step window must be contiguous, got {spec}")
        return spec.start, spec.stop
    text = str(spec).strip()
    try:
        if ":" in text:
            start_text, stop_text = text.split(":", 1)
            start = int(start_text) if start_text.strip() else 0
            stop = int(stop_text) if stop_text.strip() else None
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise ConfigError(
            f"{source}={spec!r} is not a step window; write START:STOP (stop exclusive, "
            "either side may be empty), e.g. '100:200' or '5'."
        ) from None
    if start < 0 or (stop is not None and stop <= start):
        raise ConfigError(f"{source}={spec!r} is an empty or negative step window.")
    return start, stop


def parse_ranks(spec: str | Iterable[int] | None, source: str = "ranks") -> frozenset[int] | None:
    if spec is None or spec == "":
        return None
    if not isinstance(spec, str):
        return frozenset(int(r) for r in spec)
    ranks: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                low, high = part.split("-", 1)
                ranks.update(range(int(low), int(high) + 1))
            elif part:
                ranks.add(int(part))
    except ValueError:
        raise ConfigError(f"{source}={spec!r} is not a rank list; write e.g. '0,2,4-7'.") from None
    return frozenset(ranks)


def _int_setting(value, env_name: str, default):
    if value is not None:
        return value
    text = os.environ.get(env_name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{env_name}={text!r} must be an integer.") from None


def _default_rank_world() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


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

    def selected(self, step: int, phase: str) -> bool:
        return (step >= self.step_start and (self.step_stop is None or step < self.step_stop)
                and (self.phases is None or phase in self.phases))

    @classmethod
    def resolve(cls, *, directory, rank, world_size, steps, ranks, max_tensor_bytes, flush_every, enabled,
                phases=None):
        if enabled is None:
            enabled = os.environ.get("SAMEBITS_DISABLE", "").strip() not in ("1", "true", "yes")
        if directory is None:
            directory = os.environ.get("SAMEBITS_DIR")
        if directory is None and enabled:
            raise ConfigError("Recorder needs a directory: pass one or set SAMEBITS_DIR.")
        default_rank, default_world = _default_rank_world()
        try:
            rank = default_rank if rank is None else int(rank)
            world_size = default_world if world_size is None else int(world_size)
        except (TypeError, ValueError):
            raise ConfigError(f"rank={rank!r} and world_size={world_size!r} must be integers.") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size}.")
        step_source = "steps" if steps is not None else "SAMEBITS_STEPS"
        start, stop = parse_steps(steps if steps is not None else os.environ.get("SAMEBITS_STEPS"), step_source)
        rank_source = "ranks" if ranks is not None else "SAMEBITS_RANKS"
        selected = parse_ranks(ranks if ranks is not None else os.environ.get("SAMEBITS_RANKS"), rank_source)
        cap = _int_setting(max_tensor_bytes, "SAMEBITS_MAX_TENSOR_BYTES", None)
        flush = _int_setting(flush_every, "SAMEBITS_FLUSH_STEPS", 1)
        if flush < 1:
            raise ConfigError(f"flush_every must be >= 1 step, got {flush}.")
        if phases is None:
            phases = os.environ.get("SAMEBITS_PHASES") or None
        if isinstance(phases, str):
            phases = [p.strip() for p in phases.split(",") if p.strip()]
        return cls(
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
