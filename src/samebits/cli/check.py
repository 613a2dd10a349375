"""`samebits check`: list every setting that breaks bitwise determinism, with its fix.

Rules about software this machine lacks are "not applicable"; a setting that cannot change
this machine's bits is advice, not a violation; a config in which no rule found a key it reads
is not called clean.  Exit 0 clean (advice or not), 1 violations, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None

from samebits.cli._format import echo, print_json, table
from samebits.cli._options import file_kind
from samebits.cli._lazy import lazy
from samebits.errors import ConfigError
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

run_checks, rules = lazy("samebits.determinism", "run_checks", "rules")

_MAX_KEYS_SHOWN = 10


EXAMPLES = """\
samebits check                                 # the environment
samebits check --config config.json --ignore threads.pinned
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="check the environment and a config for settings that break determinism",
        description="Check environment variables and a recipe config against the determinism "
                    "rules; every violation is listed with its fix.  Without --config, checks "
                    "the environment.  Torch flags are process state: check them in your "
                    "program with samebits.determinism.check().")
    parser.add_argument("--config", metavar="FILE",
                        help="recipe/config file to check (.json or .toml)")
    parser.add_argument("--env", action="store_true",
                        help="check environment variables (the default without --config)")
    parser.add_argument("--ignore", metavar="RULE", action="append", default=[],
                        help="skip a rule by id (repeatable); prove the setting harmless first")
    parser.add_argument("--list-rules", action="store_true", help="print the rule catalog and exit")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.list_rules:
        return _list_rules(args.json)
    config = load_config(args.config) if args.config else None
    check_env = args.env or config is None
    try:
        # devices: this process forks nothing, so it may count the GPUs (a CUDA wheel on a machine
        # without one: the CUDA rules do not apply)
        result = run_checks(config, env=check_env, torch_flags=False, ignore=args.ignore, devices=True)
    except ConfigError as err:  # unknown --ignore id
        raise ConfigError(f"--ignore: {err}") from err
    interpreted = config is None or bool(result.checked_keys)
    fmt = os.path.splitext(args.config)[1].lstrip(".").upper() if config is not None else None
    for name, known in result.near_misses.items():
        echo(f"samebits check: warning: config key {name!r} is read by no rule; "
              f"did you mean {known!r}?", file=sys.stderr)
    code = EXIT_BAD_VERDICT if result.violations else EXIT_OK if interpreted else EXIT_CANNOT_RUN
    if args.json:
        print_json({"clean": not result.violations and interpreted,
                    "violations": [v.to_dict() for v in result.violations],
                    "advice": [a.to_dict() for a in result.advice],
                    "rules_run": result.rules_run,
                    "not_applicable": result.not_applicable,
                    "config_format": fmt,
                    "checked_keys": result.checked_keys,
                    "unchecked_keys": result.unread_keys,
                    "suspicious_keys": result.near_misses})
        return code
    checked = " and ".join(filter(None, ["environment" if check_env else "",
                                         f"config {args.config}" if config is not None else ""]))
    if result.violations:
        echo(table(["RULE", "SETTING", "FOUND", "FIX"],
                    [[v.rule, v.setting, _show(v.found), v.fix] for v in result.violations]))
        echo(f"\n{len(result.violations)} violation(s) in the {checked}; "
              "details: samebits check --list-rules")
    elif interpreted:
        with_advice = f", with {len(result.advice)} piece(s) of advice below" if result.advice else ""
        echo(f"clean: the {checked} pass(es) {len(result.rules_run)} determinism rules{with_advice}")
    if result.advice:
        echo("advice (not violations: these cannot change the bits of runs on this machine as "
             "they are, only in the cases named):")
        for item in result.advice:
            echo(f"  {item.rule}: {item.setting}={_show(item.found)}: {item.when}.\n"
                 f"    to rule it out: {item.fix}")
    if config is not None:
        echo(f"config {args.config} read as {fmt}: "
              + (f"{len(result.checked_keys)} key(s) checked: {', '.join(result.checked_keys)}"
                 if result.checked_keys else "no key any rule reads"))
    if not interpreted:
        echo(f"not checked: samebits could not interpret {args.config}: none of its "
              f"{len(result.unread_keys)} key(s) is a setting a determinism rule reads, so nothing in it "
              "was checked (the config rules read keys such as num_threads, seed, moe_combine, "
              "overlap_grad_reduce at any nesting level; see samebits check --list-rules)")
    if result.not_applicable:
        by_reason: dict[str, list[str]] = {}
        for rule_id, why in result.not_applicable.items():
            by_reason.setdefault(why, []).append(rule_id)
        echo(f"not applicable on this machine ({len(result.not_applicable)} rule(s)): "
              + "; ".join(f"{', '.join(ids)}: {why}" for why, ids in by_reason.items()))
    if result.unread_keys:
        shown = ", ".join(result.unread_keys[:_MAX_KEYS_SHOWN])
        more = len(result.unread_keys) - _MAX_KEYS_SHOWN
        echo(f"note: {len(result.unread_keys)} config key(s) read by no rule: {shown}"
              + (f" and {more} more" if more > 0 else ""))
    return code


def load_config(path: str) -> dict:
    """Read a JSON or TOML config file into a dict, with a clear error for each failure."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".json", ".toml"):
        raise ConfigError(f"--config {path}: unsupported format {ext or '(no extension)'!r}; "
                            "use a .json or .toml file")
    if ext == ".toml" and tomllib is None:
        raise ConfigError(f"--config {path}: TOML needs Python 3.11+ (tomllib); use JSON")
    try:
        # O_NONBLOCK: a FIFO in place of the file must not block the open (nor a device the read)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise ConfigError(f"--config {path}: cannot read it: {err.strerror or err}") from err
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ConfigError(f"--config {path}: {file_kind(mode)}, not a regular file; expected a .json or .toml "
                          "config file.")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read()
        except OSError as err:
            raise ConfigError(f"--config {path}: cannot read it: {err.strerror or err}") from err
    try:
        config = (json.loads if ext == ".json" else tomllib.loads)(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"--config {path}: not UTF-8 text ({err.reason} at byte "
                            f"{err.start})") from err
    except json.JSONDecodeError as err:
        raise ConfigError(f"--config {path}: invalid JSON at line {err.lineno}, column "
                            f"{err.colno}: {err.msg}") from err
    except RecursionError:
        raise ConfigError(f"--config {path}: nested too deeply to be a config") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path}: invalid TOML: {err}") from err
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path}: must hold an object of options at top level, "
                            f"found a {type(config).__name__}")
    return config


def _list_rules(as_json: bool) -> int:
    catalog = rules()
    if as_json:
        print_json({"rules": [{"id": r.id, "category": r.category, "setting": r.setting,
                               "checks": r.checks, "why": r.why, "fix": r.fix} for r in catalog]})
    else:
        echo(table(["RULE", "CATEGORY", "CHECKS"],
                    [[r.id, r.category, r.checks] for r in catalog]))
    return EXIT_OK


def _show(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)
