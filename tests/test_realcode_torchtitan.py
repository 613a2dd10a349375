"""torchtitan 0.3.0's own training code under samebits (tests/realcode/torchtitan/).

The manifest's planted lines are checked here; the unmodified 1-rank llama3 debug model under
`samebits verify` with its own DCP checkpoint resume runs as docs/integrations.md shows it
(tests/test_docs_realcode.py, with the `realcode` extra).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TITAN = ROOT / "tests" / "realcode" / "torchtitan"
CASES = json.loads((TITAN / "cases.json").read_text())["cases"]


@pytest.mark.parametrize("case", [c for c in CASES if "planted" in c], ids=lambda c: c["name"])
def test_planted_line_is_marked(case):
    """Every fault case points at the `# PLANTED` line of a file in this folder that its commands run."""
    script, line = case["planted"].split(":")
    lines = (TITAN / script).read_text().splitlines()
    assert "# PLANTED" in lines[int(line) - 1], f"{case['name']}: {case['planted']} is not the marked line"
    commands = " ".join(case["run"] + case["samebits"])
    if script == "tiny_llama3.py":  # a config function: the case must select it
        function = next(re.match(r"def (\w+)\(", lines[n]).group(1) for n in range(int(line) - 1, -1, -1)
                        if lines[n].startswith("def "))
        assert re.search(rf"--config {function}(\s|$)", commands), f"{case['name']} does not use {function}"
    else:
        assert f"{{corpus}}/{script}" in commands, f"{case['name']} does not run {script}"


# The unmodified run under verify with its resume is the torchtitan block of docs/integrations.md,
# run as written by tests/test_docs_realcode.py.
