"""Text from files and runs made visible and inert: what the terminal (`samebits.cli._format`)
and the page (`samebits.runners.report.page`) both show of names, paths and values.

A control, format (bidi) or separator character, or a byte of a path that is not UTF-8, is
written as a visible escape (``\\x1b``, ``\\u202e``, ``\\xff``): such text can neither drive a
terminal (repaint a DIVERGED headline as "IDENTICAL") nor reorder a line, nor fail to encode.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

# Cc controls, Cf format characters (bidi marks and overrides, zero-width and tag characters),
# Zl/Zp separators, Cs lone surrogates (the bytes of a non-UTF-8 path, as Python decodes them)
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Candidates: all but printable ASCII (and the newline, when kept); `_escaped` returns the safe
# ones unchanged, so plain ASCII text costs one scan.
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


def visible(value: Any, keep_newlines: bool = False) -> str:
    """``str(value)`` with every unsafe character written as a visible escape (see above)."""
    text = value if isinstance(value, str) else str(value)
    return (_CANDIDATES_KEEP_NEWLINES if keep_newlines else _CANDIDATES).sub(_escaped, text)


__all__ = ["visible"]
