"""Shared output helpers for the CLI: terminal-safe text, aligned plain-text tables, JSON.

Everything a person reads passes through `escape`: names, phases, paths and config values
come from files and runs, and a control character in one (an ANSI escape sequence, a
carriage return, a bidi override) could repaint the terminal, e.g. turn a DIVERGED headline
into "IDENTICAL".  JSON output stays exact (the json module escapes control characters).
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Iterable, Sequence

# C0 and C1 controls, DEL, and the Unicode bidi embedding/override/isolate characters.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_KEEP_NEWLINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escaped(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(value: Any, keep_newlines: bool = False) -> str:
    """``str(value)`` with every control character written as a visible escape (``\\x1b``)."""
    text = value if isinstance(value, str) else str(value)
    return (_UNSAFE_KEEP_NEWLINES if keep_newlines else _UNSAFE).sub(_escaped, text)


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Render rows as a left-aligned text table with a rule under the header; every cell
    is escaped (`escape`), so a cell can neither break the layout nor drive the terminal."""
    cells = [[escape(h) for h in headers]] + [["" if c is None else escape(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def echo(*parts: Any, file=None, flush: bool = False, sep: str = " ") -> None:
    """`print` for text a person reads: every control character but the newline is escaped."""
    text = sep.join(p if isinstance(p, str) else str(p) for p in parts)
    print(escape(text, keep_newlines=True), file=file if file is not None else sys.stdout, flush=flush)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
