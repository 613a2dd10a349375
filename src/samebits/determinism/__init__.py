"""Deterministic mode: set (`deterministic_mode`), check (`check`, `validate`, the rule
catalog), look up (`lookup_op`) and probe (`probe`) everything that decides run-to-run bits.
See docs/determinism.md.
"""

from samebits.determinism._mode import DeterministicMode, active_record, deterministic_mode
from samebits.determinism._ops import OpEntry, lookup_op, op_catalog
from samebits.determinism._probe import (DEFAULT_COMPARISONS, NotCompared, Probe, ProbeFinding, ProbeReport,
                                         miss_bound, probe)
from samebits.determinism._probe_command import CommandProbeResult, probe_command
from samebits.determinism._probe_command import start as start_command_probe
from samebits.determinism._rules import (CheckContext, ConfigView, Rule, RuleFinding, Violation, check,
                                         register_rule, rule, rules, run_checks, unregister_rule, validate)
from samebits.determinism._seeds import SEED_PURPOSES, derive_seed, seed_all
from samebits.errors import DeterminismError

__all__ = ["deterministic_mode", "DeterministicMode", "active_record", "derive_seed", "seed_all", "SEED_PURPOSES",
           "check", "validate", "rules", "rule", "register_rule", "unregister_rule", "Rule", "RuleFinding",
           "Violation", "CheckContext", "ConfigView", "DeterminismError", "lookup_op", "op_catalog", "OpEntry",
           "probe", "start_command_probe", "Probe", "ProbeReport", "NotCompared", "miss_bound",
           "DEFAULT_COMPARISONS", "ProbeFinding", "probe_command", "CommandProbeResult", "run_checks"]
