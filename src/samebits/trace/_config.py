"""Tracing settings (`TraceConfig`), their ``SAMEBITS_TRACE*`` variables, and the record names.

A traced record has phase ``trace:<category>:<training phase>`` and name
``<event id>|<role>:<label>`` (role ``in`` or ``out``); docs/tracing.md, "Record names and
ids", lists the categories and training phases.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from samebits import settings
from samebits.errors import ConfigError
from samebits.stream.phases import TRACE_PHASE_PREFIX, TRAINING_PHASES

LEVELS = {"off": 0, "phases": 1, "modules": 2, "ops": 3}
LEVEL_NAMES = {value: name for name, value in LEVELS.items()}
CATEGORIES = ("state", "phase", "collective", "module", "op", "probe", "census")
# Context records: observed at a step's start, never events (never an origin on their own).
CONTEXT_CATEGORIES = ("census",)
CENSUS_EVENT, CENSUS_PHASE = "census", "start"  # trace:census:start / census|at:rng.torch_cpu
PRE_PHASE = "pre"  # a step's work before its first phase boundary (not the census's "start")
# A list argument's provenance: which recorded tensors it holds, sorted (@set) and in order (@order).
ORDER_LABEL, SET_LABEL = "@order", "@set"

ENV_VARS = ("SAMEBITS_TRACE", "SAMEBITS_TRACE_STEPS", "SAMEBITS_TRACE_RANKS", "SAMEBITS_TRACE_MODULE",
            "SAMEBITS_TRACE_STACK", "SAMEBITS_TRACE_DUMP_OP", "SAMEBITS_TRACE_DUMP_DIR",
            "SAMEBITS_TRACE_STOP_AFTER", "SAMEBITS_TEST_PERTURB")


@dataclass(frozen=True)
class EventSpec:
    """One event on one rank at one step: what `SAMEBITS_TRACE_DUMP_OP` and
    `SAMEBITS_TEST_PERTURB` name.  ``id`` is a full event id (``scope/aten::mm:0``, a
    collective id ``world/all_reduce:1``) or, for ops, ``aten::mm:3``: the fourth call of
    that op in the step, whatever its scope and phase."""

    step: int
    rank: int
    id: str
    phase: str | None = None

    @property
    def is_global_op_count(self) -> bool:
        return "/" not in self.id

    def to_env(self) -> str:
        text = f"step={self.step},rank={self.rank},id={self.id}"
        return text + (f",phase={self.phase}" if self.phase else "")

    @classmethod
    def parse(cls, text: str, source: str) -> "EventSpec":
        fields = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"{source}={text!r}: {part!r} is not KEY=VALUE; write e.g. "
                                 "'step=2,rank=1,id=layers.0/aten::mm:0' (id may also be spelled op=).")
            fields[key.strip()] = value.strip()
        if "op" in fields and "id" not in fields:
            fields["id"] = fields.pop("op")
        unknown = set(fields) - {"step", "rank", "id", "phase"}
        if unknown or not {"step", "rank", "id"} <= set(fields):
            raise ConfigError(f"{source}={text!r}: needs step=, rank= and id= (or op=), optionally "
                             f"phase=; got {sorted(fields)}.")
        try:
            step, rank = int(fields["step"]), int(fields["rank"])
        except ValueError:
            raise ConfigError(f"{source}={text!r}: step and rank must be integers.") from None
        phase = fields.get("phase") or None
        if phase is not None and phase not in TRAINING_PHASES:
            raise ConfigError(f"{source}={text!r}: phase must be one of {', '.join(TRAINING_PHASES)}.")
        return cls(step, rank, fields["id"], phase)


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """What to trace: built directly, or by `from_env` (docs/settings.md, "Tracing")."""

    level: int = 0
    """0 off, 1 phases (+ collectives, gradients, optimizer state), 2 modules, 3 ATen ops."""

    step_start: int = 0
    """First traced step."""

    step_stop: int | None = None
    """Traced steps are step_start <= step < step_stop (None: no end)."""

    ranks: frozenset[int] | None = None
    """Traced ranks (None: all)."""

    module: str = ""
    """Module subtree (an FQN) for rungs 2 and 3; "" is the whole model."""

    call_sites: bool = False
    """Remember the Python call site of each traced op (costs a stack walk per op)."""

    dump: EventSpec | None = None
    """Save this event's inputs and outputs (plain tensors, torch.save) into dump_dir."""

    dump_dir: Path | None = None
    """Where dumps and call-site files go; None: the recorder's run directory."""

    stop_after: int | None = None
    """Raise SystemExit(0) once this step has been written (bisect re-runs stop early)."""

    perturb: EventSpec | None = None
    """Test only: nudge this event's first output by one ulp."""

    def __post_init__(self):
        if self.level not in LEVEL_NAMES:
            raise ConfigError(f"trace level {self.level} must be one of 0-3 ({', '.join(LEVELS)}).")
        if self.step_start < 0 or (self.step_stop is not None and self.step_stop <= self.step_start):
            raise ConfigError(f"trace steps {self.step_start}:{self.step_stop} is an empty window.")

    @property
    def enabled(self) -> bool:
        """True when anything at all must be installed."""
        return self.level > 0 or self.perturb is not None or self.dump is not None or self.stop_after is not None

    def step_selected(self, step: int) -> bool:
        return step >= self.step_start and (self.step_stop is None or step < self.step_stop)

    def rank_selected(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def in_subtree(self, scope: str) -> bool:
        m = self.module
        return not m or scope == m or scope.startswith(m + ".")

    def with_(self, **changes) -> "TraceConfig":
        return replace(self, **changes)

    @classmethod
    def from_env(cls, environ=None) -> "TraceConfig":
        env = os.environ if environ is None else environ
        text = (settings.read("SAMEBITS_TRACE", env) or "").lower()
        if text in ("", "0", "off", "none"):
            level = 0
        elif text in LEVELS:
            level = LEVELS[text]
        elif text.isdigit() and int(text) in LEVEL_NAMES:
            level = int(text)
        else:
            raise ConfigError(f"SAMEBITS_TRACE={text!r}: choose one of {', '.join(LEVELS)} (or 0-3).")
        start, stop = settings.read("SAMEBITS_TRACE_STEPS", env)
        dump = settings.read("SAMEBITS_TRACE_DUMP_OP", env)
        perturb = settings.read("SAMEBITS_TEST_PERTURB", env)
        dump_dir = settings.read("SAMEBITS_TRACE_DUMP_DIR", env)
        return cls(
            level=level, step_start=start, step_stop=stop, ranks=settings.read("SAMEBITS_TRACE_RANKS", env),
            module=settings.read("SAMEBITS_TRACE_MODULE", env),
            call_sites=settings.read("SAMEBITS_TRACE_STACK", env),
            dump=EventSpec.parse(dump, "SAMEBITS_TRACE_DUMP_OP") if dump else None,
            dump_dir=Path(dump_dir) if dump_dir else None,
            stop_after=settings.read("SAMEBITS_TRACE_STOP_AFTER", env),
            perturb=EventSpec.parse(perturb, "SAMEBITS_TEST_PERTURB") if perturb else None,
        )

    def to_env(self) -> dict[str, str]:
        """The variables that make a child process trace like this (unset ones omitted)."""
        stop = "" if self.step_stop is None else self.step_stop
        env = {
            "SAMEBITS_TRACE": LEVEL_NAMES[self.level],
            "SAMEBITS_TRACE_STEPS": f"{self.step_start}:{stop}" if self.step_start or stop != "" else None,
            "SAMEBITS_TRACE_RANKS": None if self.ranks is None else ",".join(map(str, sorted(self.ranks))),
            "SAMEBITS_TRACE_MODULE": self.module or None,
            "SAMEBITS_TRACE_STACK": "1" if self.call_sites else None,
            "SAMEBITS_TRACE_DUMP_OP": None if self.dump is None else self.dump.to_env(),
            "SAMEBITS_TRACE_DUMP_DIR": None if self.dump_dir is None else str(self.dump_dir),
            "SAMEBITS_TRACE_STOP_AFTER": None if self.stop_after is None else str(self.stop_after),
            "SAMEBITS_TEST_PERTURB": None if self.perturb is None else self.perturb.to_env(),
        }
        return {name: value for name, value in env.items() if value is not None}


# -- record names ------------------------------------------------------------------------


def record_phase(category: str, training_phase: str) -> str:
    return f"{TRACE_PHASE_PREFIX}{category}:{training_phase}"


def record_name(event_id: str, role: str, label) -> str:
    return f"{event_id}|{role}:{label}"


def source_prefix(training_phase: str, event_id: str, role: str) -> str:
    """What `StepState.mark_all_seen` prefixes to a label: ``phase|<event id>|<role>:``, so that
    a tensor's source is its record's phase and name (stable across runs)."""
    return f"{training_phase}|{event_id}|{role}:"


class TraceRef(NamedTuple):
    """A traced record's name and phase, parsed."""

    category: str
    training_phase: str
    event_id: str
    role: str  # "in" | "out"
    label: str


def parse_record(phase: str, name: str) -> TraceRef | None:
    """The trace fields of a record, or None for a record the tracer did not write."""
    if not phase.startswith(TRACE_PHASE_PREFIX):
        return None
    category, _, training_phase = phase[len(TRACE_PHASE_PREFIX):].partition(":")
    event_id, sep, rest = name.rpartition("|")
    if not sep:
        return None
    role, _, label = rest.partition(":")
    return TraceRef(category, training_phase, event_id, role, label)


def split_op_id(event_id: str) -> tuple[str, str, int | None]:
    """``layers.1.ffn/aten::index_put:0`` -> (scope, op, occurrence)."""
    scope, _, rest = event_id.rpartition("/")
    op, sep, count = rest.rpartition(":")
    return (scope, op, int(count)) if sep and count.isdigit() else (scope, rest, None)


def parent_scope(fqn: str) -> str:
    return fqn.rpartition(".")[0]

