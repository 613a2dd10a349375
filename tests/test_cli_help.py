"""The command line's own surface: help without the library, --version, 'did you mean'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import samebits
from samebits.cli import build_parser, main

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def test_help_loads_no_torch():
    """`samebits --help` and every command's --help build the parser without the library: no torch, no
    numpy (they cost seconds; cli/_lazy.py imports them when a command runs)."""
    script = f"""
import json, sys
from samebits.cli import main
for argv in [["--help"]] + [[name, "--help"] for name in {COMMANDS!r}]:
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in ("torch", "numpy", "samebits.stream", "samebits.runs") if m in sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_lazy_name_loads_its_module_when_called():
    from samebits.cli import diff as diff_command
    from samebits.compare import DiffResult

    assert isinstance(DiffResult.__new__(DiffResult), diff_command.DiffResult)
    assert diff_command.diff.resolve() is samebits.compare.diff
