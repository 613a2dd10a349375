"""Results read back from disk by the marks that write them (`samebits.verdicts.ToDict.from_dict`):
a summary.json whose field was renamed, retyped or dropped is one error naming the file and the
field, never a page that quietly misses what it says (issue 36 item 3)."""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from pathlib import Path

import pytest

from samebits.errors import ConfigError
from samebits.runners.bisect import BisectResult, Origin, Stage
from samebits.runners.report import build_report
from samebits.verdicts import ToDict, Verdict, serialised


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:  # a dataclass that is not a ToDict: written and read field by field
    x: int
    where: Path


@dataclasses.dataclass
class Inner(ToDict):
    step: int
    name: str | None = None


@dataclasses.dataclass
class Marked(ToDict):
    dict_keys = ("verdict", "exit_code", "id", "count", "inner", "point", "seen", "colours", "by_rank", "extra")
    summary_of = "demo"

    verdict: Verdict
    event_id: str = dataclasses.field(default="e", metadata=serialised(key="id"))
    secret: object = dataclasses.field(default="kept", metadata=serialised(skip=True))
    count: float = dataclasses.field(default=1.25, metadata=serialised(convert=lambda v: round(v, 2)))
    maybe: int | None = dataclasses.field(default=None, metadata=serialised(omit_none=True))
    inner: Inner | None = None
    point: Point = dataclasses.field(default_factory=lambda: Point(1, Path("/a/b")))
    seen: set[str] = dataclasses.field(default_factory=lambda: {"b", "a"})
    colours: tuple[Colour, ...] = (Colour.RED,)
    by_rank: dict[int, Verdict] = dataclasses.field(default_factory=lambda: {1: Verdict.PASS})
    flat: dict = dataclasses.field(default_factory=lambda: {"extra": 7}, metadata=serialised(flatten=True))
    # written only inside an extra: read back by its mark
    ranks: list[int] = dataclasses.field(default_factory=list, metadata=serialised(
        skip=True, read=lambda data: list((data.get("inner") or {}).get("ranks", []))))

    def dict_extras(self) -> dict:
        inner = None if self.inner is None else {**self.inner.to_dict(), "ranks": self.ranks}
        return {"exit_code": self.verdict.exit_code, "inner": inner}


def test_a_result_reads_back_what_it_wrote_by_the_same_marks():
    result = Marked(Verdict.FAIL, event_id="x", inner=Inner(3, "w"), ranks=[2, 0], by_rank={0: Verdict.FAIL})
    written = json.loads(json.dumps(result.to_dict()))
    assert list(written)[:2] == ["command", "verdict"] and written["command"] == "demo"
    back = Marked.from_dict(written, source="summary.json")
    assert back == dataclasses.replace(result, secret="kept")  # a skipped field takes its default
    assert isinstance(back.point.where, Path) and back.by_rank == {0: Verdict.FAIL} and back.ranks == [2, 0]
    assert back.colours == (Colour.RED,) and back.seen == {"a", "b"} and back.verdict is Verdict.FAIL
    old = {key: value for key, value in written.items() if key != "command"}  # a file written before the field
    assert Marked.from_dict(old) == back


@pytest.mark.parametrize("entry, value, said", [
    ("exit_code", "1", "'exit_code' must be a number, found a string"),
    ("inner", {"step": 3, "name": None, "ranks": "0"}, "'inner.ranks' must be a list, found a string"),
])
def test_a_computed_entry_of_another_type_is_an_error_naming_it(entry, value, said):
    # computed entries (dict_extras) are derived again, not read: a damaged one was read past,
    # and the page, which reads them from the file, failed on it with a traceback
    written = json.loads(json.dumps(Marked(Verdict.FAIL, inner=Inner(3)).to_dict()))
    with pytest.raises(ConfigError, match=re.escape(said)):
        Marked.from_dict({**written, entry: value}, source="summary.json")


def _bisect_summary(root: Path) -> Path:
    origin = Origin(kind="generator", conclusion="origin: rng.torch_cpu differs at step 8", step=8, rank=0,
                    phase="state", module=None, op=None, event_id=None, category="state", classification="origin",
                    call_site="train.py:12", elements=None, catalog=None, detail="", state_differs=["rng.torch_cpu"],
                    state_differs_all=["rng.torch_cpu"])
    stage = Stage("steps", "phases", "all steps, every rank", {"a": 1.0, "b": 1.0}, "diverged", None, "origin")
    result = BisectResult(verdict=Verdict.DIVERGED, origin=origin, stages=[stage], out=str(root), compared="a vs b",
                          conclusion=origin.conclusion)
    root.mkdir(parents=True)
    (root / "summary.json").write_text(json.dumps(result.to_dict(), default=str))
    return root / "summary.json"


def _edit(file: Path, change) -> None:
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def test_a_real_summary_reads_back_into_its_result(tmp_path):
    file = _bisect_summary(tmp_path / "bisect")
    data = json.loads(file.read_text())
    result = BisectResult.from_dict(data, source=file)
    assert isinstance(result.origin, Origin) and isinstance(result.stages[0], Stage)
    assert result.verdict is Verdict.DIVERGED and result.stages[0].runs == {"a": 1.0, "b": 1.0}
    assert json.loads(json.dumps(result.to_dict(), default=str)) == data


@pytest.mark.parametrize("change, field", [
    (lambda d: d.__setitem__("origins", d.pop("origin")), "origins"),  # renamed: the old page showed "no origin"
    (lambda d: d["stages"][0].__setitem__("result", d["stages"][0].pop("verdict")), "stages[0].result"),
    (lambda d: d.pop("compared"), "compared"),  # a field every summary holds, missing
    (lambda d: d["stages"][0].__setitem__("runs_s", [1.0]), "stages[0].runs_s"),  # retyped
    (lambda d: d.__setitem__("verdict", "passed"), "verdict"),
])
def test_a_renamed_or_retyped_field_is_an_error_naming_the_file_and_the_field(tmp_path, change, field):
    file = _bisect_summary(tmp_path / "bisect")
    _edit(file, change)
    with pytest.raises(ConfigError) as caught:
        BisectResult.from_dict(json.loads(file.read_text()), source=file)
    assert str(file) in str(caught.value) and repr(field) in str(caught.value), caught.value
    with pytest.raises(ConfigError) as caught:  # and the page refuses it, saying the same
        build_report([file.parent])
    assert str(file) in str(caught.value) and repr(field) in str(caught.value), caught.value


def test_a_summary_is_read_by_the_command_it_names_and_one_naming_none_is_refused(tmp_path):
    file = _bisect_summary(tmp_path / "bisect")
    assert build_report([file.parent]).kind == "bisect"  # every summary names its command (`summary_of`)
    _edit(file, lambda data: data.pop("command"))  # as samebits before 2026-12 wrote it: no guessing by its keys
    with pytest.raises(ConfigError) as caught:
        build_report([file.parent])
    assert str(file) in str(caught.value) and "'command' is None" in str(caught.value) and \
        "run the command again" in str(caught.value), caught.value
