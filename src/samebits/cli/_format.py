"""Shared output helpers for the CLI: terminal-safe text, aligned plain-text tables, JSON,
and `print_result`, how a command ends (its result, printed; its verdict, the exit code).

Everything a person reads passes through `escape`: names, phases, paths and config values
come from files and runs, and a control character in one (an ANSI escape sequence, a
carriage return, a bidi override) could repaint the terminal, e.g. turn a DIVERGED headline
into "IDENTICAL".  JSON output stays exact (the json module escapes control characters).
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
import unicodedata
from typing import Any, Callable, Iterable, Sequence

# What `escape` writes visibly instead of passing on: C0 and C1 controls and DEL (Cc), format
# characters (Cf: the bidi marks, embeddings, overrides and isolates U+061C, U+200E/F,
# U+202A-E, U+2066-9, zero-width characters, tag characters), the line and paragraph separators
# (Zl, Zp) and lone surrogates (Cs: the bytes of a path that is not UTF-8, as Python decodes them).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Candidates: every character but printable ASCII (and the newline, when kept); `_escaped`
# returns the safe ones unchanged, so plain ASCII text costs one scan.
_CANDIDATES = re.compile("[^\x20-\x7e]")
_CANDIDATES_KEEP_NEWLINES = re.compile("[^\x20-\x7e\n]")


def _escaped(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    if code < 0x20 or 0x7f <= code <= 0x9f:
        return f"\\x{code:02x}"
    if 0xdc80 <= code <= 0xdcff:  # a byte that was not UTF-8 (os.fsdecode's surrogateescape): shown as that byte
        return f"\\x{code - 0xdc00:02x}"
    if unicodedata.category(char) in _UNSAFE_CATEGORIES:
        return f"\\u{code:04x}" if code <= 0xffff else f"\\U{code:08x}"
    return char


def escape(value: Any, keep_newlines: bool = False) -> str:
    """``str(value)`` with every control, format and bidi character written as a visible escape
    (``\\x1b``, ``\\u202e``) and every byte of a non-UTF-8 path as ``\\xNN``: the result can
    neither drive the terminal nor fail to encode."""
    text = value if isinstance(value, str) else str(value)
    return (_CANDIDATES_KEEP_NEWLINES if keep_newlines else _CANDIDATES).sub(_escaped, text)


TABLE_WIDTH = 100  # columns a table may take; a wider cell wraps onto more lines


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], max_width: int | None = TABLE_WIDTH) -> str:
    """Render rows as a left-aligned text table with a rule under the header; every cell
    is escaped (`escape`), so a cell can neither break the layout nor drive the terminal.
    The table fits ``max_width`` columns: the widest columns are narrowed first (never below
    8 characters or their natural width) and a cell wider than its column wraps onto more
    lines, at spaces where it can, so nothing is cut.  ``max_width=None``: no limit."""
    cells = [[escape(h) for h in headers]] + [["" if c is None else escape(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    if max_width is not None:
        widths = _fit(widths, max_width - 2 * (len(headers) - 1))
    lines = []
    for number, row in enumerate(cells):
        wrapped = [_wrap(c, w) for c, w in zip(row, widths)]
        for i in range(max(len(parts) for parts in wrapped)):
            lines.append("  ".join((parts[i] if i < len(parts) else "").ljust(w)
                                   for parts, w in zip(wrapped, widths)).rstrip())
        if number == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False,
                         drop_whitespace=True) or [""]


def _fit(widths: list[int], budget: int) -> list[int]:
    """Column widths summing to at most ``budget`` where they can: every column above a
    common cap is narrowed to it (the largest cap that fits), none below its floor (8, or
    its natural width if narrower)."""
    if sum(widths) <= budget:
        return widths
    floors = [min(w, 8) for w in widths]
    low, high = 0, max(widths)
    while low < high:  # the largest cap whose widths still fit
        cap = (low + high + 1) // 2
        if sum(max(f, min(w, cap)) for w, f in zip(widths, floors)) <= budget:
            low = cap
        else:
            high = cap - 1
    return [max(f, min(w, low)) for w, f in zip(widths, floors)]


def echo(*parts: Any, file=None, flush: bool = False, sep: str = " ") -> None:
    """`print` for text a person reads: every control character but the newline is escaped."""
    text = sep.join(p if isinstance(p, str) else str(p) for p in parts)
    print(escape(text, keep_newlines=True), file=file if file is not None else sys.stdout, flush=flush)


def progress_printer(command: str, file=None) -> Callable[[str], None]:
    """The progress line of long work (verify, bisect, matrix, report), on stderr: each
    message after the time since the command started, ``[  12.3s] [2/4] run B ...``; the
    library's messages carry the step counter.  Lines after the first of a message are
    indented under it."""
    began = time.perf_counter()

    def progress(message: str) -> None:
        stamp = f"[{time.perf_counter() - began:6.1f}s] "
        text = str(message).replace("\n", "\n" + " " * len(stamp))
        echo(stamp + text, file=file if file is not None else sys.stderr, flush=True)

    return progress


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def print_result(result: Any, as_json: bool, render: Callable[[Any], str]) -> int:
    """A command's last act: print ``result`` (``result.to_dict()`` as JSON, or ``render(result)``
    for a person) and return its verdict's exit code."""
    if as_json:
        print_json(result.to_dict())
    else:
        echo(render(result))
    return result.verdict.exit_code
