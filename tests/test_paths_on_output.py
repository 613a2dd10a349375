"""Paths that are not UTF-8 on output (issue 34 item 8): `verify --across ... --out $'o\\xff'` raised
UnicodeEncodeError writing the run's log header in runs/_launch.py.  The log shows such a byte as
``\\xff``; the run itself gets the path as given."""

from __future__ import annotations

import os
import sys

from samebits.runners._launch import run_logged


def test_a_log_header_with_a_path_that_is_not_utf8_is_escaped(tmp_path):
    odd = os.fsdecode(b"o\xff")  # how Python holds the byte: a lone surrogate
    log = tmp_path / "logs" / "dp1.log"
    code, _ = run_logged([sys.executable, "-c", "import sys; open(sys.argv[1], 'wb').write(b'ok')",
                          str(tmp_path / odd)], log)
    assert code == 0
    assert (tmp_path / odd).read_bytes() == b"ok"  # the run got the path's own bytes
    header = log.read_text(encoding="utf-8").splitlines()[0]
    assert header.startswith("$ ") and "o\\xff" in header
