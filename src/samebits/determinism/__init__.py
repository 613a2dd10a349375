"""Deterministic mode: set, check and probe everything that decides run-to-run bits.

- `deterministic_mode(...)` sets torch flags, environment, thread count and seeds, fails
  closed on bad values the user set, and publishes a record (`active_record()`).
- `check(config)` / `validate(config)` run the rule catalog (`rules()`, extend it with
  `@rule(...)` or `register_rule`).
- `lookup_op(name)` looks an ATen op up in the catalog of known-nondeterministic ops.
- `probe(fn, ...)` runs a step with every op executed twice and lists the ops that
  actually gave different bits on this machine.

See docs/determinism.md.
"""

from samebits.determinism._mode import DeterministicMode, active_record, deterministic_mode
from samebits.determinism._ops import OpEntry, lookup_op, op_catalog
from samebits.determinism._probe import DEFAULT_COMPARISONS, NotCompared, Probe, ProbeFinding, ProbeReport, miss_bound, probe
from samebits.determinism._probe_command import CommandProbeResult, probe_command
from samebits.determinism._probe_command import start as start_command_probe
from samebits.determinism._rules import (
    CheckContext,
    ConfigView,
    Rule,
    RuleFinding,
    Violation,
    check,
    register_rule,
    rule,
    rules,
    run_checks,
    unregister_rule,
    validate,
)
from samebits.determinism._seeds import SEED_PURPOSES, derive_seed, seed_all
from samebits.errors import DeterminismError

__all__ = [
    "deterministic_mode",
    "DeterministicMode",
    "active_record",
    "derive_seed",
    "seed_all",
    "SEED_PURPOSES",
    "check",
    "validate",
    "rules",
    "rule",
    "register_rule",
    "unregister_rule",
    "Rule",
    "RuleFinding",
    "Violation",
    "CheckContext",
    "ConfigView",
    "DeterminismError",
    "lookup_op",
    "op_catalog",
    "OpEntry",
    "probe",
    "start_command_probe",
    "Probe",
    "ProbeReport",
    "NotCompared",
    "miss_bound",
    "DEFAULT_COMPARISONS",
    "ProbeFinding",
    "probe_command",
    "CommandProbeResult",
    "run_checks",
]
