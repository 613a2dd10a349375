"""Shared output helpers for the CLI: terminal-safe text, plain-text tables, JSON, and
`print_result` (the result printed, the verdict's exit code returned).

Everything a person reads passes through `escape`: names and paths come from files and runs,
and a control character in one could repaint the terminal (turn DIVERGED into "IDENTICAL").
"""

from __future__ import annotations

import json
import sys
import textwrap
import time
from typing import Any, Callable, Iterable, Sequence

from samebits.visible import visible as escape

TABLE_WIDTH = 100  # columns a table may take; a wider cell wraps onto more lines


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], max_width: int | None = TABLE_WIDTH) -> str:
    """Rows as a left-aligned text table, every cell escaped, fitting ``max_width`` columns (None:
    no limit): the widest columns narrow first (`_fit`) and a wider cell wraps, so nothing is cut."""
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
    """Column widths within ``budget`` where they can: every column above the largest cap that
    fits is narrowed to it, none below 8 (or its natural width if narrower)."""
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


def progress_printer() -> Callable[[str], None]:
    """Progress on stderr, each message after the time since the command started
    (``[  12.3s] [2/4] run B ...``), its later lines indented under the first."""
    began = time.perf_counter()

    def progress(message: str) -> None:
        stamp = f"[{time.perf_counter() - began:6.1f}s] "
        text = str(message).replace("\n", "\n" + " " * len(stamp))
        echo(stamp + text, file=sys.stderr, flush=True)

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
