"""What the comparator finds: a rank's first `Divergence`, the decoded `RankStep` around it,
and the whole comparison's `DiffResult` (what `samebits diff --json` prints)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from samebits.stream import Record
from samebits.verdicts import ToDict, Verdict, serialised


@dataclass
class Divergence(ToDict):
    """The first difference on one rank: a step, and the first differing record in it."""

    step: int
    rank: int
    reason: str  # "content" | "order" | "only_in_a" | "only_in_b" | "ended_a" | "ended_b"
    phase: str | None = None
    name: str | None = None
    occurrence: int | None = None
    kind: str | None = None
    a: dict | None = None
    b: dict | None = None
    records_differing: int = 0
    # index of the first differing record in the step (orders ranks; not part of the JSON)
    position: int = field(default=0, metadata=serialised(skip=True))
    detail: str = ""


@dataclass
class RankStep:
    """One rank's first divergent step: the decoded records of both runs there (a side without
    the step has an empty list and is named in ``missing``)."""

    rank: int
    step: int
    records_a: list[Record]
    records_b: list[Record]
    missing: str | None = None  # "a" or "b": that run has no such step
    detail: str = ""


@dataclass
class ResumedWindow(ToDict):
    """The window a diff chose itself: run ``run`` ("a" or "b") starts at ``step`` (it resumed
    the other's checkpoint there) and no --from-step was given, so it compared from ``step``."""

    run: str
    step: int


def resumed_note(label: str, first: int, other_first: int) -> str:
    """The note of a comparison that starts at run ``label``'s first step, where it resumed."""
    return (f"{label} starts at step {first} and {'a' if label == 'b' else 'b'} at step {other_first} "
            f"({label} resumed a run?): compared from step {first} on")


def resumed_unjudged(label: str, first: int) -> str:
    """Why no divergence after a resume is no verdict: the earlier steps are in one run only."""
    return (f"no divergence from step {first} on, where {label} starts ({label} resumed a run?); the earlier "
            f"steps are in the other run only. To judge the resume, compare the steps both hold: --from-step {first}")


@dataclass
class DiffResult(ToDict):
    """What `diff` found.  ``verdict`` is a `Verdict`: IDENTICAL, DIVERGED or INCOMPLETE
    (could not decide: a stream missing or cut short, or a window holding no step)."""

    dict_keys = ("verdict", "exit_code", "a", "b", "first_divergence", "divergences_by_rank", "compared",
                 "resumed", "incomplete", "notes")

    a: str
    b: str
    verdict: Verdict
    first_divergence: Divergence | None  # written with the ranks that diverge first (`dict_extras`)
    ranks_diverged_first: list[int] = field(metadata=serialised(  # written in first_divergence (`dict_extras`)
        skip=True, read=lambda data: list((data.get("first_divergence") or {}).get("ranks", []))))
    divergences: dict[int, Divergence] = field(  # per rank, its first divergence (if any)
        metadata=serialised(key="divergences_by_rank", convert=lambda by_rank: {
            str(rank): divergence.to_dict() for rank, divergence in sorted(by_rank.items())}))
    compared: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # why the verdict could not be IDENTICAL
    resumed: ResumedWindow | None = field(default=None, metadata=serialised(omit_none=True))  # the window it chose

    @property
    def identical(self) -> bool:
        return self.verdict is Verdict.IDENTICAL

    def dict_extras(self) -> dict:
        first = None
        if self.first_divergence is not None:
            first = {**self.first_divergence.to_dict(), "ranks": self.ranks_diverged_first}
        return {"exit_code": self.verdict.exit_code, "first_divergence": first}
