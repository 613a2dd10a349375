"""The options of the byte tests, defined once for the pytest plugin (``--samebits-<name>``)
and the CLI (``--<name>``); a bad value fails with a `ConfigError` naming the option.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from samebits.errors import ConfigError


def _runs(text: str, source: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"{source}={text!r} must be an integer (the number of runs compared, >= 2).") from None
    if value < 2:
        raise ConfigError(f"{source}={value}: a repeatability check needs at least 2 runs; write e.g. {source}=3.")
    return value


def _packages(text: str, source: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise ConfigError(f"{source}={text!r}: name at least one importable package, e.g. {source}=mypkg.")
    return names


@dataclass(frozen=True)
class Option:
    """One option: ``kind`` is "flag" (on when given) or "value" (parsed by ``parse``)."""

    name: str
    kind: str
    default: Any
    help: str
    metavar: str | None = None
    parse: Callable[[str, str], Any] | None = None

    @property
    def pytest_flag(self) -> str:
        return f"--samebits-{self.name}"

    @property
    def cli_flag(self) -> str:
        return f"--{self.name}"

    @property
    def dest(self) -> str:
        return f"samebits_{self.name.replace('-', '_')}"

    def argparse_kwargs(self, flag: str) -> dict:
        if self.kind == "flag":
            return {"action": "store_true", "default": self.default, "help": self.help, "dest": self.dest}
        parse = self.parse

        def checked(text: str) -> Any:
            try:
                return parse(text, flag)
            except ConfigError as err:  # argparse prints the message and exits 2
                raise argparse.ArgumentTypeError(str(err)) from None

        return {"type": checked, "default": self.default, "help": self.help, "metavar": self.metavar,
                "dest": self.dest}


OPTIONS: dict[str, Option] = {option.name: option for option in (
    Option("update", "flag", False,
           "record instead of check: rewrite golden digest files (pytest) or the kernel manifest's "
           "source hashes (samebits coverage); commit the result"),
    Option("contention", "flag", False,
           "run byte tests under a background workload competing for the cores (GEMMs on a side "
           "stream on a GPU)"),
    Option("runs", "value", 3, "runs compared per thread count in a byte test (>= 2; default 3)", "N", _runs),
    Option("coverage", "value", None,
           "check kernel coverage of these packages (comma-separated) at the end of the session",
           "PACKAGE[,PACKAGE...]", _packages),
    Option("manifest", "value", None,
           "the kernel manifest (default: the one kernel-coverage.toml inside the package)", "FILE",
           lambda text, source: text),
)}


# Session defaults for byte-test arguments left as None; the pytest plugin sets them from
# --samebits-runs and --samebits-contention.  Kept here (no torch) so the plugin can load
# without importing the harness.
SESSION_DEFAULTS: dict[str, Any] = {"runs": OPTIONS["runs"].default, "contention": OPTIONS["contention"].default}
observers: list[Callable[[Any], None]] = []  # called with each BitwiseReport (the plugin's summary)


def add_to_argparse(parser: argparse.ArgumentParser, *names: str) -> None:
    """Add the named options to a CLI parser as ``--<name>`` (stored as ``samebits_<name>``)."""
    for name in names:
        option = OPTIONS[name]
        parser.add_argument(option.cli_flag, **option.argparse_kwargs(option.cli_flag))


def add_to_pytest(group) -> None:
    """Add every option to a pytest option group as ``--samebits-<name>``."""
    for option in OPTIONS.values():
        group.addoption(option.pytest_flag, **option.argparse_kwargs(option.pytest_flag))
