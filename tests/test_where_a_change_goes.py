"""docs/architecture.md "Where a change goes", executable (issue 36).

The doc names, for each everyday change (a command, a parallel axis, a kind of state), the
files it touches in a numbered list and the test that plants it.  Here: each list holds at most
three files and each exists, each planting test exists, and the state plant (the one whose test
lives here) is named by verify, wired through `CensusName` or, unplanted, still listed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import samebits
from samebits.checkpoint import CensusName, _names
from samebits.runners._explain import explain_resume, ordered

ROOT = Path(__file__).resolve().parent.parent
CHANGES = ("Add a command.", "Add a parallel axis", "Record a new kind of state")
MAX_FILES = 3


def _section(title: str) -> str:
    """The doc's paragraph of one change: from its bold title to the next bold title."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Where a change goes", 1)[1]
    start = text.index(f"**{title}")
    end = text.find("\n**", start + 2)
    return text[start:] if end < 0 else text[start:end]


def _files(section: str) -> list[str]:
    """The files of a change: the path each numbered line starts with."""
    return re.findall(r"^\d+\. `(src/samebits/[^`]+)`", section, re.M)


def _planted_by(section: str) -> str:
    return re.search(r"planted by\s+`(tests/[^`]+)`", section).group(1)


@pytest.mark.parametrize("title", CHANGES)
def test_each_change_touches_at_most_three_files_that_exist(title):
    files = _files(_section(title))
    assert 1 <= len(files) <= MAX_FILES, f"{title!r} touches {len(files)} files: {files}"
    for path in files:
        if "<name>" in path:  # a command: its folder exists, and it is discovered there
            assert (ROOT / path).parent.is_dir(), path
        else:
            assert (ROOT / path).is_file(), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("title", CHANGES)
def test_each_change_is_planted_by_a_test_that_exists(title):
    file, _, name = _planted_by(_section(title)).partition("::")
    tree = ast.parse((ROOT / file).read_text())
    assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, (file, name)


def test_the_map_fails_on_a_fourth_file():
    """The check above can fail: a section with four numbered files is over the limit."""
    section = "**Record**\n\n" + "".join(f"{i}. `src/samebits/f{i}.py`: x\n" for i in range(1, 5))
    assert len(_files(section)) == 4 > MAX_FILES


# -- the state plant -----------------------------------------------------------------------

WIDGET = "widget"  # the planted kind: records "widget.<key>"


def _census_run(root: Path, name: str, steps: range, widget: float) -> Path:
    """A run with a main stream and a census of one optimizer plus the planted ``widget.w0``
    record and a record of no known kind (``frobnicator``), both holding ``widget``."""
    main = samebits.Recorder(root / name, config={"lr": 0.1})
    census = samebits.Recorder(root / name / "state", config={"lr": 0.1})
    for step in steps:
        main.tensors(step, "params", [("w", torch.full((2,), float(step)))])
        main.end_step(step)
        census.tensors(step, "state", [("optim0.step", torch.tensor([float(step)])),
                                       ("widget.w0", torch.tensor([widget])),
                                       ("frobnicator", torch.tensor([widget]))])
        census.end_step(step)
    main.close()
    census.close()
    return root / name


def test_a_new_kind_of_state_is_named_by_verify(tmp_path, monkeypatch):
    """A kind added to `CensusName` (the first file of the map) parses and formats back, and a
    record of it that differs at the resume step is a finding of verify's with no rule of its
    own; a record of no known kind is listed the same way, never a silent difference."""
    monkeypatch.setitem(_names._PREFIXES, WIDGET, "widget.")
    parsed = CensusName.parse("widget.w0")
    assert (parsed.kind, parsed.key, str(parsed)) == (WIDGET, "w0", "widget.w0")

    a = _census_run(tmp_path, "a", range(3), widget=1.0)
    c = _census_run(tmp_path, "c", range(1, 3), widget=2.0)
    findings = ordered(explain_resume(a, None, c, 1, 1))
    said = {(f.kind, f.record) for f in findings if f.step == 1}
    assert {("other_state", "widget.w0"), ("other_state", "frobnicator")} <= said, findings
    widget = next(f for f in findings if f.record == "widget.w0")
    assert "training state 'widget.w0' differs at step start" in widget.says
