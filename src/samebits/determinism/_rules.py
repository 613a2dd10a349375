"""The rule catalog: rule and violation types, the registry, and `check` / `validate`.

Rules never change anything: `check` lists every violation at once and `validate` raises them
together in one `DeterminismError` (fail closed).  A finding that cannot change this machine's
bits as they are is `Advice`, which `check` and `validate` ignore (docs/determinism.md).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple

from samebits.errors import ConfigError, DeterminismError
from samebits.verdicts import ToDict, serialised

CATEGORIES = ("env", "torch", "config")
"""env: environment variables; torch: flags of the running process; config: recipe options."""

UNSET = "<unset>"

FEATURES = {
    "cuda": "this torch is built without CUDA (torch.version.cuda is None)",
    "gpu": "no GPU is visible on this machine (torch.cuda.device_count() is 0), so CUDA settings cannot "
           "change the bits of its runs",
    "nccl": "this torch has no NCCL (torch.distributed.is_nccl_available() is False)",
    "transformer_engine": "Transformer Engine is not installed",
    "flash_attn": "flash-attn is not installed",
    "mamba_ssm": "mamba-ssm is not installed",
    "causal_conv1d": "causal-conv1d is not installed",
}
"""What a rule may require of this machine's software (`Rule.requires`), and the reason
given when it is missing: a rule about a library that is not there is "not applicable"."""


def detect_platform(*, devices: bool = False) -> dict[str, bool]:
    """Which `FEATURES` this Python environment has (packages are looked up, not imported).
    ``devices`` counts the GPUs, which initialises the CUDA driver: `samebits check` (its own
    process) counts; `check()` in a training process that may fork does not."""
    import torch
    import torch.distributed as dist

    cuda = torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None
    found = {"cuda": cuda, "gpu": cuda and (not devices or torch.cuda.device_count() > 0),
             "nccl": cuda and dist.is_available() and dist.is_nccl_available()}
    for package in ("transformer_engine", "flash_attn", "mamba_ssm", "causal_conv1d"):
        found[package] = importlib.util.find_spec(package) is not None
    return found


class RuleFinding(NamedTuple):
    """What a rule function yields per offending setting (`check` makes it a `Violation`).
    `fix` overrides the rule's generic fix; `advice` (the only cases in which the setting
    changes the bits) makes it advice rather than a violation."""

    setting: str
    found: Any
    fix: str | None = None
    advice: str = ""


@dataclass(frozen=True)
class Violation(ToDict):
    """One setting that breaks bitwise determinism, with the rule it breaks and the fix."""

    rule: str
    setting: str
    found: Any = field(metadata=serialised(convert=lambda found: _jsonable(found)))  # any value: repr() if not plain
    fix: str
    why: str = ""

    def __str__(self) -> str:
        return f"[{self.rule}] {self.setting} = {_show(self.found)}: {self.fix}"


@dataclass(frozen=True)
class Advice(ToDict):
    """A setting that changes this machine's bits only in the cases `when` names; `fix` rules them out."""

    rule: str
    setting: str
    found: Any = field(metadata=serialised(convert=lambda found: _jsonable(found)))
    when: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.setting} = {_show(self.found)}: {self.when}; to rule it out: {self.fix}"


@dataclass(frozen=True)
class Rule:
    """A determinism rule: `func(ctx)` returns or yields a `RuleFinding` per offending setting
    (nothing: it passes).  `keys`: config keys it reads beyond those `ctx.config.find` tracks."""

    id: str
    category: str
    setting: str
    checks: str
    why: str
    fix: str
    func: Callable[["CheckContext"], Iterable[RuleFinding] | RuleFinding | None] = field(repr=False)
    keys: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    """`FEATURES` the rule is about; on a machine without one it is reported "not applicable"."""

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ConfigError(f"rule {self.id!r}: category must be one of {CATEGORIES}, "
                              f"got {self.category!r}")
        if not self.id or any(c.isspace() for c in self.id):
            raise ConfigError(f"rule id must be a non-empty word without spaces, got {self.id!r}")
        unknown = sorted(set(self.requires) - set(FEATURES))
        if unknown:
            raise ConfigError(f"rule {self.id!r}: requires {unknown}, known features: {sorted(FEATURES)}")


class ConfigView(Mapping):
    """A read-only view of a nested config dict by dotted paths (``moe.combine``).  `find(name)`
    matches the last path component, at top level or in any section; every name looked up is
    remembered, to report config keys that no rule read."""

    def __init__(self, config: Mapping):
        self.raw = config
        self._flat: dict[str, Any] = {}
        self._flatten(config, "")
        self.names_read: set[str] = set()

    def _flatten(self, obj: Mapping, prefix: str) -> None:
        for key, value in obj.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping) and value:
                self._flatten(value, path + ".")
            else:
                self._flat[path] = value

    def find(self, name: str) -> list[tuple[str, Any]]:
        self.names_read.add(name)
        return [(p, v) for p, v in self._flat.items() if p.rsplit(".", 1)[-1] == name]

    def __getitem__(self, path: str) -> Any:
        self.names_read.add(path.rsplit(".", 1)[-1])
        return self._flat[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat)

    def __len__(self) -> int:
        return len(self._flat)

    def leaf_names(self) -> set[str]:
        return {p.rsplit(".", 1)[-1] for p in self._flat}


@dataclass
class CheckContext:
    """What a rule function sees: the config (None when not checking one) and the environment."""

    config: ConfigView | None
    environ: Mapping[str, str]


@dataclass
class CheckResult:
    """Everything one check produced; `check` returns only `violations`, the CLI shows all."""

    violations: list[Violation]
    rules_run: list[str]
    unread_keys: list[str] = field(default_factory=list)
    near_misses: dict[str, str] = field(default_factory=dict)
    not_applicable: dict[str, str] = field(default_factory=dict)  # rule id -> why it does not apply here
    advice: list[Advice] = field(default_factory=list)  # findings that cannot change this machine's bits
    checked_keys: list[str] = field(default_factory=list)  # config keys some rule read and found


_REGISTRY: dict[str, Rule] = {}


def register_rule(new_rule: Rule, *, replace: bool = False) -> Rule:
    """Add a rule to the catalog; `replace=True` overrides a rule with the same id."""
    if new_rule.id in _REGISTRY and not replace:
        raise ConfigError(f"a determinism rule with id {new_rule.id!r} is already registered; "
                          "pick another id or pass replace=True")
    _REGISTRY[new_rule.id] = new_rule
    return new_rule


def unregister_rule(rule_id: str) -> None:
    """Remove a rule (mostly for tests and for replacing built-ins)."""
    _REGISTRY.pop(rule_id, None)


def rule(id: str, *, category: str, setting: str, checks: str, why: str, fix: str,
         keys: Iterable[str] = (), requires: Iterable[str] = ()) -> Callable:
    """Decorator form of `register_rule`: the decorated function becomes the rule's check
    (docs/determinism.md, "Adding a rule")."""
    def decorate(func):
        register_rule(Rule(id=id, category=category, setting=setting, checks=checks,
                           why=why, fix=fix, func=func, keys=tuple(keys), requires=tuple(requires)))
        return func
    return decorate


def rules(category: str | None = None) -> list[Rule]:
    """The registered rules in registration order (built-ins first), optionally one category."""
    _ensure_builtins()
    return [r for r in _REGISTRY.values() if category is None or r.category == category]


RULE_PLUGINS = "samebits.rules"  # entry-point group: modules that register rules when imported
_plugins_loaded = False


def _ensure_builtins() -> None:
    """The built-in rules, then every rule plugin (entry points `RULE_PLUGINS`), imported once."""
    global _plugins_loaded
    importlib.import_module("samebits.determinism._builtin_rules")  # registers them on import
    if _plugins_loaded:
        return
    _plugins_loaded = True  # before importing: a plugin calls back into this module
    for entry in sorted(importlib.metadata.entry_points(group=RULE_PLUGINS), key=lambda e: e.name):
        importlib.import_module(entry.value)


def run_checks(config: Mapping | None = None, *, env: bool = True,
               torch_flags: bool | None = None, ignore: Iterable[str] = (),
               environ: Mapping[str, str] | None = None,
               platform: Mapping[str, bool] | None = None, devices: bool = False) -> CheckResult:
    """Run every applicable rule and collect the full result (see `check`); a rule whose
    `Rule.requires` this machine lacks is listed in ``not_applicable`` instead."""
    _ensure_builtins()
    if config is not None and not isinstance(config, Mapping):
        raise TypeError(f"config must be a dict (or None), got {type(config).__name__}")
    ignore = set(ignore)
    unknown = ignore - set(_REGISTRY)
    if unknown:
        raise ConfigError(f"cannot ignore unknown rule id(s) {sorted(unknown)}; "
                          f"known ids: {sorted(_REGISTRY)}")
    torch_flags = env if torch_flags is None else torch_flags
    enabled = {"env": env, "torch": torch_flags, "config": config is not None}
    view = ConfigView(config) if config is not None else None
    ctx = CheckContext(config=view, environ=os.environ if environ is None else environ)
    result = CheckResult(violations=[], rules_run=[])
    for r in list(_REGISTRY.values()):
        if not enabled[r.category] or r.id in ignore:
            continue
        if r.requires:
            if platform is None:
                platform = detect_platform(devices=devices)
            missing = [feature for feature in r.requires if not platform.get(feature, False)]
            if missing:
                result.not_applicable[r.id] = FEATURES[missing[0]]
                continue
        if view is not None:
            view.names_read.update(r.keys)
        result.rules_run.append(r.id)
        for finding in _as_findings(r.func(ctx), r.id):
            if finding.advice:
                result.advice.append(Advice(rule=r.id, setting=finding.setting, found=finding.found,
                                            when=finding.advice, fix=finding.fix or r.fix))
                continue
            result.violations.append(Violation(rule=r.id, setting=finding.setting,
                                               found=finding.found, fix=finding.fix or r.fix,
                                               why=r.why))
    if view is not None:
        result.unread_keys = unread = sorted(view.leaf_names() - view.names_read)
        result.checked_keys = sorted(view.leaf_names() & view.names_read)
        known = sorted(view.names_read)
        for name in unread:
            close = [k for k in known if _looks_like_typo(name, k)]
            if close:
                result.near_misses[name] = close[0]
    return result


def check(config: Mapping | None = None, *, env: bool = True, torch_flags: bool | None = None,
          ignore: Iterable[str] = ()) -> list[Violation]:
    """List every determinism violation; an empty list means clean.

    ``config`` (nested sections allowed; None skips the config rules), ``env`` (environment
    variables, and the torch flags unless ``torch_flags`` says otherwise: the CLI passes False,
    a fresh CLI process's flags say nothing of training's), ``ignore`` (rule ids: a waiver).
    A key that looks like a misspelt known key gives a warning; other unread keys are ignored.
    """
    result = run_checks(config, env=env, torch_flags=torch_flags, ignore=ignore)
    if result.near_misses:
        listed = ", ".join(f"{k!r} (did you mean {v!r}?)" for k, v in result.near_misses.items())
        warnings.warn(f"config keys that no determinism rule reads look like known keys: {listed}",
                      stacklevel=2)
    return result.violations


def validate(config: Mapping | None = None, *, env: bool = True,
             torch_flags: bool | None = None, ignore: Iterable[str] = ()) -> None:
    """Like `check`, but raise one `DeterminismError` listing every violation and its fix."""
    violations = check(config, env=env, torch_flags=torch_flags, ignore=ignore)
    if violations:
        raise violation_error(violations)


def violation_error(violations: list[Violation], context: str = "") -> DeterminismError:
    """One `DeterminismError` that lists every violation with its fix."""
    head = f"{len(violations)} setting(s) break bitwise determinism" + (f" ({context})" if context else "")
    lines = [head + "; fix all of them and run again:", *(f"  - {v}" for v in violations)]
    return DeterminismError("\n".join(lines), violations)


def _looks_like_typo(name: str, known: str) -> bool:
    """One edit (insert, delete, substitute, swap) apart; two for long names.  Deliberately
    tight: `num_heads` is a real key, not a misspelt `num_threads`."""
    limit = 2 if min(len(name), len(known)) >= 12 else 1
    if abs(len(name) - len(known)) > limit:
        return False
    # Optimal string alignment distance (Levenshtein plus adjacent transpositions).
    prev2, prev = None, list(range(len(known) + 1))
    for i, a in enumerate(name, 1):
        row = [i] + [0] * len(known)
        for j, b in enumerate(known, 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a != b))
            if prev2 is not None and i > 1 and j > 1 and a == known[j - 2] and name[i - 2] == b:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1] <= limit


def _as_findings(returned: Any, rule_id: str) -> list[RuleFinding]:
    if returned is None:
        return []
    if isinstance(returned, RuleFinding):
        return [returned]
    findings = list(returned)
    for f in findings:
        if not isinstance(f, RuleFinding):
            raise TypeError(f"determinism rule {rule_id!r} yielded {f!r}; rule functions must "
                            "return or yield samebits.determinism.RuleFinding(setting, found)")
    return findings


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _show(value: Any) -> str:
    return value if isinstance(value, str) and value == UNSET else repr(value)
