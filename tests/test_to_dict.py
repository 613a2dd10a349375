"""Results serialise from their dataclass fields (`samebits.verdicts.ToDict`), with the
exceptions marked on the field or the class; the JSON of each command stays what it was.

The expected dicts below are what the hand-written ``to_dict`` methods returned before they
were derived (keys in order, values), for representative results of each package."""

from __future__ import annotations

import ast
import dataclasses
import enum
from pathlib import Path

import pytest

from samebits.compare import DiffResult, Divergence
from samebits.determinism._probe import ProbeFinding, ProbeReport
from samebits.determinism._rules import Violation
from samebits.runners.bisect import BisectResult, ControlFlow, Elements, Origin, Stage
from samebits.trace import OriginFinding
from samebits.verdicts import ToDict, Verdict, plain, serialised

SRC = Path(__file__).resolve().parents[1] / "src" / "samebits"


class Colour(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Point:  # a dataclass that is not a ToDict: written field by field
    x: int
    where: Path


@dataclasses.dataclass
class Marked(ToDict):
    dict_keys = ("verdict", "exit_code", "id", "count", "inner", "seen", "colours", "extra", "by_rank")

    verdict: Verdict
    event_id: str = dataclasses.field(default="e", metadata=serialised(key="id"))
    secret: object = dataclasses.field(default=None, metadata=serialised(skip=True))
    count: float = dataclasses.field(default=1.23456, metadata=serialised(convert=lambda v: round(v, 2)))
    maybe: int | None = dataclasses.field(default=None, metadata=serialised(omit_none=True))
    inner: Point = dataclasses.field(default_factory=lambda: Point(1, Path("/a/b")))
    seen: set = dataclasses.field(default_factory=lambda: {"b", "a"})
    colours: tuple = (Colour.RED,)
    by_rank: dict = dataclasses.field(default_factory=lambda: {1: Verdict.PASS})
    flat: dict = dataclasses.field(default_factory=lambda: {"extra": 7}, metadata=serialised(flatten=True))

    def dict_extras(self) -> dict:
        return {"exit_code": self.verdict.exit_code}


def test_derived_dict_follows_the_marks():
    assert list(Marked(Verdict.FAIL).to_dict().items()) == [
        ("verdict", "fail"), ("exit_code", 1), ("id", "e"), ("count", 1.23), ("inner", {"x": 1, "where": "/a/b"}),
        ("seen", ["a", "b"]), ("colours", ["red"]), ("extra", 7), ("by_rank", {"1": "pass"})]


def test_without_dict_keys_every_field_in_order_then_the_extras():
    @dataclasses.dataclass
    class Plain(ToDict):
        b: int = 2
        a: int | None = dataclasses.field(default=None, metadata=serialised(omit_none=True))
        skipped: int = dataclasses.field(default=0, metadata=serialised(skip=True))

        def dict_extras(self) -> dict:
            return {"sum": Path("x")}

    assert list(Plain().to_dict().items()) == [("b", 2), ("sum", "x")]
    assert list(Plain(a=1).to_dict().items()) == [("b", 2), ("a", 1), ("sum", "x")]


def test_bad_marks_and_non_dataclasses_fail_clearly():
    with pytest.raises(ValueError, match=r"skip=True\) takes no other option"):
        serialised(skip=True, key="x")
    with pytest.raises(ValueError, match="flatten=True.*no key"):
        serialised(flatten=True, key="x")

    class NotData(ToDict):
        pass

    with pytest.raises(NotImplementedError, match="NotData is not a dataclass"):
        NotData().to_dict()
    assert plain({Colour.RED: (1, {2})}) == {"red": [1, [2]]}


FINDING = dict(category="op", phase="forward", event_id="m/aten::mm:0", module="m", op="aten::mm", role="out",
               label="0", record="trace:op:forward/x", position=5, call_site="t.py:1", detail="d",
               state_differs=["rng.python"], state_unused=["rng.numpy"], permuted=True,
               reordered={"group": "g", "a": ["x"], "b": ["y"]})
ELEMENTS = {"differing": 1, "total": 2, "max_ulp": 3, "values": [], "dtype": "f", "shape": [2], "output": "0",
            "pair": ["a1", "b1"], "dumps": ["x", "y"], "same_values": False, "inputs_identical": True,
            "inputs_differ": ["i"], "inputs_permuted": True}
ORIGIN = {"kind": "op", "conclusion": "c", "step": 3, "rank": 1, "phase": "forward", "module": "m", "op": "aten::mm",
          "id": "m/aten::mm:0", "category": "op", "classification": "origin", "call_site": "t.py:1",
          "elements": ELEMENTS, "catalog": "cat", "detail": "d", "state_differs": ["rng.python"],
          "state_differs_all": ["rng.python", "rng.numpy"]}


def _finding() -> OriginFinding:
    return OriginFinding(1, 3, "origin", **FINDING)


def _elements() -> Elements:
    detail = {k: ELEMENTS[k] for k in ("differing", "total", "max_ulp", "values", "dtype", "shape")}
    return Elements(detail, "0", ["a1", "b1"], ["x", "y"], False, True, ["i"], True)


def test_bisect_json_is_unchanged():
    finding = _finding()
    finding.catalog = "cat"
    origin = Origin.of(finding, _elements(), "op", "c", state_differs=["rng.python"])
    assert list(origin.to_dict().items()) == list(ORIGIN.items())
    assert origin.step == 3 and origin.event_id == "m/aten::mm:0"  # an Origin is its finding, concluded
    finding.catalog = None
    stage = Stage("steps", "phases", "scope", {"a": 1.23456}, "diverged", finding, "sum")
    result = BisectResult(Verdict.DIVERGED, origin, [stage], "out", "a vs b", {"a": True}, ControlFlow(2, 0, "d"),
                          ["n"], 12.345, "c")
    expected_finding = {"rank": 1, "step": 3, "classification": "origin", "category": "op", "phase": "forward",
                        "event_id": "m/aten::mm:0", "module": "m", "op": "aten::mm", "role": "out", "label": "0",
                        "record": "trace:op:forward/x", "position": 5, "a": None, "b": None, "from_rank": None,
                        "call_site": "t.py:1", "catalog": None, "detail": "d", "parted": None,
                        "state_differs": ["rng.python"], "state_unused": ["rng.numpy"], "permuted": True,
                        "reordered": {"group": "g", "a": ["x"], "b": ["y"]}}
    expected = {"command": "bisect", "verdict": "diverged", "conclusion": "c", "origin": ORIGIN,  # names its command
                "stages": [{"name": "steps", "rung": "phases", "scope": "scope", "runs_s": {"a": 1.23},
                            "verdict": "diverged", "finding": expected_finding, "summary": "sum"}],
                "compared": "a vs b", "repeatable": {"a": True}, "control_flow": {"step": 2, "rank": 0, "detail": "d"},
                "out": "out", "notes": ["n"], "seconds": 12.3}
    assert result.to_dict() == expected and list(result.to_dict()) == list(expected)
    assert list(result.to_dict()["stages"][0]["finding"]) == list(expected_finding)


def test_replicas_origin_adds_its_params_and_ranks():
    origin = Origin(rank=1, step=0, classification="origin", category="state", phase="init", event_id="params",
                    detail="c", kind="replicas", conclusion="c", params=["w"], ranks=[0, 1])
    out = origin.to_dict()
    assert list(out)[-4:] == ["state_differs", "state_differs_all", "params", "ranks"]
    assert (out["params"], out["ranks"], out["module"], out["elements"]) == (["w"], [0, 1], None, None)


def test_diff_probe_and_rule_json_is_unchanged():
    order = Divergence(2, 1, "order")
    content = Divergence(2, 0, "content", "p", "n", 0, "tensor", {"x": 1}, None, 3, 4, "det")
    result = DiffResult("a", "b", Verdict.DIVERGED, order, [1, 0], {1: order, 0: content}, {"steps": 3}, ["n"], ["i"])
    plain_order = {"step": 2, "rank": 1, "reason": "order", "phase": None, "name": None, "occurrence": None,
                   "kind": None, "a": None, "b": None, "records_differing": 0, "detail": ""}
    expected = {"verdict": "diverged", "exit_code": 1, "a": "a", "b": "b",
                "first_divergence": {**plain_order, "ranks": [1, 0]},
                "divergences_by_rank": {"0": {"step": 2, "rank": 0, "reason": "content", "phase": "p", "name": "n",
                                              "occurrence": 0, "kind": "tensor", "a": {"x": 1}, "b": None,
                                              "records_differing": 3, "detail": "det"}, "1": plain_order},
                "compared": {"steps": 3}, "incomplete": ["i"], "notes": ["n"]}
    assert list(result.to_dict().items()) == list(expected.items())
    assert list(result.to_dict()["first_divergence"]) == list(expected["first_divergence"])

    report = ProbeReport([ProbeFinding("aten::mm", "m", "t.py:1", 3, 10, 2, 1, "known")], 10, 5, 1.23456, object())
    assert list(report.to_dict().items()) == [
        ("clean", False), ("num_ops", 10), ("num_ops_compared", 5), ("seconds", 1.235),
        ("findings", [{"op": "aten::mm", "module": "m", "call_site": "t.py:1", "elements_differing": 3,
                       "numel": 10, "calls": 2, "calls_differing": 1, "known": "known"}])]
    violation = Violation("r", "s", {"k": (1, 2), 3: None, "o": Colour.RED}, "fix")
    assert violation.to_dict() == {"rule": "r", "setting": "s", "found": {"k": [1, 2], "3": None,
                                                                           "o": repr(Colour.RED)},
                                   "fix": "fix", "why": ""}


# The result classes that still write their dict by hand, each with its reason.
BY_HAND = {
    "stream/_records.py::Record": "its keys depend on its kind (a metric: value and bits; a tensor: shape, "
                                "numel, digest, absent, capped), as docs/stream.md shows a record",
    "recipes/config.py::RecipeConfig": "the recipe is a client: its config is dataclasses.asdict",
}


def test_results_write_no_to_dict_by_hand():
    """One serialiser: a result class derives its dict (the marks say the exceptions); only
    ToDict itself defines to_dict, and the classes of BY_HAND, each with its reason."""
    by_hand = []
    for file in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != "ToDict":
                if any(isinstance(item, ast.FunctionDef) and item.name == "to_dict" for item in node.body):
                    by_hand.append(f"{file.relative_to(SRC)}::{node.name}")
    assert sorted(by_hand) == sorted(BY_HAND)
