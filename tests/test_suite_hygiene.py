"""The suite cannot end itself: no test module (or script it imports) exits at import.

A worker script that ends with ``os._exit(0)`` (to skip gloo's C++ static destructors) must do
so inside its ``if __name__ == "__main__":`` block.  At module level, pytest's import of the file
ends the whole session with exit code 0 and nothing run after it: a green CI that tested
nothing.  That happened once.  conftest.py refuses to start a session when a file does it
(before importing any test module); these tests check the checker.
"""

from __future__ import annotations

import ast

from _hygiene import _module_level_exits, exits_at_import


def test_no_test_file_exits_at_import():
    assert exits_at_import() == []


def test_the_check_sees_a_module_level_exit(tmp_path):
    bad = "import os\nif __name__ == '__main__':\n    main()\nos._exit(0)\n"
    good = "import os, sys\nif __name__ == '__main__':\n    main()\n    os._exit(0)\ndef f():\n    sys.exit(1)\n"
    assert list(_module_level_exits(ast.parse(bad))) == [4]
    assert list(_module_level_exits(ast.parse(good))) == []
    (tmp_path / "test_bad.py").write_text(bad)
    (tmp_path / "worker.py").write_text(good)
    assert exits_at_import(tmp_path) == ["test_bad.py:4"]
