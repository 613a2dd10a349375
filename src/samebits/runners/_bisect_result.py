"""What `samebits bisect` returns: its stages, the origin it concludes, and the element detail
of the origin's dumped outputs (`samebits.runners.bisect`'s results, written by its narrowing,
`samebits.runners._bisect_narrow`, and its sentences, `samebits.runners._bisect_prose`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from samebits.trace import OriginFinding
from samebits.verdicts import ToDict, Verdict, serialised


@dataclass
class Stage(ToDict):
    name: str
    rung: str
    scope: str  # what the stage traced, in words
    runs: dict[str, float] = field(default_factory=dict, metadata=serialised(  # label -> seconds
        key="runs_s", convert=lambda runs: {label: round(seconds, 2) for label, seconds in runs.items()}))
    verdict: str = ""
    finding: OriginFinding | None = None
    summary: str = ""


class DifferingElement(NamedTuple):
    index: list[int]
    a: Any
    b: Any
    ulp: int


@dataclass
class Elements(ToDict):
    """How the origin's two dumped outputs differ element by element: `compare_elements`'s
    result (``detail``, whose entries its dict holds first) for output ``output`` of the dumps
    ``pair`` (files ``dumps``)."""

    detail: dict = field(metadata=serialised(flatten=True))
    output: str
    pair: list[str]
    dumps: list[str]
    same_values: bool  # one output is a permutation of the other
    inputs_identical: bool  # every input matched in value and position
    inputs_differ: list[str] = field(default_factory=list)  # the input labels whose values differ
    inputs_permuted: bool = False  # the inputs hold the same tensors, in other positions

    @property
    def differing(self) -> int | None:
        return self.detail["differing"]

    @property
    def total(self) -> int:
        return self.detail["total"]

    @property
    def max_ulp(self) -> int | None:
        return self.detail["max_ulp"]

    @property
    def values(self) -> list["DifferingElement"]:
        """The first differing elements: index, both values, distance in ulps."""
        return [DifferingElement(v["index"], v["a"], v["b"], v["ulp"]) for v in self.detail["values"]]

    @property
    def dtype(self) -> str:
        return self.detail["dtype"]

    @property
    def shape(self) -> list[int]:
        return self.detail["shape"]


@dataclass(kw_only=True)
class Origin(OriginFinding):
    """What the bisection concludes: the `OriginFinding` it rests on, plus ``kind`` (docs/tracing.md
    "The conclusion"), the sentence for a person and the origin's ``elements``; ``state_differs``
    the census records it blames, ``state_differs_all`` every one differing at the step start."""

    # Bisect's public JSON: the conclusion, then the finding's where, what and why.
    dict_keys = ("kind", "conclusion", "step", "rank", "phase", "module", "op", "id", "category", "classification",
                 "call_site", "elements", "catalog", "detail", "state_differs", "state_differs_all", "params",
                 "ranks")

    kind: str
    conclusion: str
    elements: Elements | None = None
    state_differs_all: list[str] = field(default_factory=list)
    params: list[str] | None = field(default=None, metadata=serialised(omit_none=True))  # replicas: those that differ
    ranks: list[int] | None = field(default=None, metadata=serialised(omit_none=True))  # replicas: the ranks involved

    @classmethod
    def of(cls, finding: OriginFinding, elements: Elements | None, kind: str, conclusion: str,
           state_differs: list[str] | None = None) -> "Origin":
        """The `Origin` that ``finding`` proves; ``state_differs`` default: all that differ at the step start."""
        found = {item.name: getattr(finding, item.name) for item in fields(OriginFinding)}
        found["state_differs"] = list(finding.state_differs if state_differs is None else state_differs)
        return cls(**found, kind=kind, conclusion=conclusion, elements=elements,
                   state_differs_all=list(finding.state_differs) + list(finding.state_unused))

    def dict_extras(self) -> dict:
        return {"id": self.event_id}


@dataclass
class ControlFlow(ToDict):
    """Where the two runs' recorded event sequences part."""

    step: int
    rank: int
    detail: str


@dataclass
class BisectResult(ToDict):
    summary_of = "bisect"  # its summary.json names the command that wrote it

    dict_keys = ("verdict", "conclusion", "origin", "stages", "compared", "repeatable", "control_flow", "out", "notes",
                 "seconds")

    verdict: Verdict  # IDENTICAL or DIVERGED (a run that could not be compared raises instead)
    origin: Origin | None
    stages: list[Stage]
    out: str
    compared: str  # e.g. "a vs b", "a vs a (a is not repeatable)"
    repeatable: dict[str, bool] | None = None
    control_flow: ControlFlow | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = field(default=0.0, metadata=serialised(convert=lambda seconds: round(seconds, 1)))
    conclusion: str = ""  # one sentence: what differs and where the origin is (or why it is not known)


__all__ = ["Stage", "Elements", "DifferingElement", "Origin", "ControlFlow", "BisectResult"]
