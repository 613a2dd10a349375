"""Compare two runs by global tensor identity (`diff --by global`): runs of different layouts,
matched by (phase, name, occurrence) step by step (docs/stream.md, "Runs of different layouts").
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from typing import Any

from samebits.compare._results import ResumedWindow, resumed_note, resumed_unjudged
from samebits.compare._rule import record_match
from samebits.stream.reader import Run, open_run, require_same_digest_version
from samebits.stream import GLOBAL_PHASE_PREFIX
from samebits.verdicts import ToDict, Verdict, serialised

VALUES_NOT_RECORDED = "values not recorded (streams hold digests only)"


@dataclass
class GlobalTensorResult(ToDict):
    """One global tensor across the window: ``status`` "identical", "differs", "ranks_disagree"
    (one run's ranks hold different digests), "only_in_a" or "only_in_b" from ``first_step``."""

    phase: str
    name: str
    occurrence: int
    status: str
    first_step: int | None
    steps_compared: int
    a: dict | None  # {dtype, shape, digest} at first_step (or the last step compared)
    b: dict | None
    detail: str = ""
    max_ulp: int | None = None

    def dict_extras(self) -> dict:
        return {"values": None if self.max_ulp is not None else VALUES_NOT_RECORDED}


@dataclass
class GlobalDiffResult(ToDict):
    """What `diff_global` found; ``verdict`` is a `Verdict` (IDENTICAL, DIVERGED, INCOMPLETE)."""

    dict_keys = ("verdict", "exit_code", "by", "a", "b", "first_divergence", "tensors", "compared", "resumed",
                 "incomplete", "notes")

    a: str
    b: str
    verdict: Verdict
    first_step: int | None  # the first step any global tensor differs
    tensors: list[GlobalTensorResult]  # every tensor seen, in first-seen order
    compared: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    # one run starts later (it resumed the other): compared from its first step (as DiffResult's)
    resumed: ResumedWindow | None = field(default=None, metadata=serialised(omit_none=True))

    @property
    def identical(self) -> bool:
        return self.verdict is Verdict.IDENTICAL

    @property
    def differing_at_first_step(self) -> list[GlobalTensorResult]:
        return [t for t in self.tensors if t.status != "identical" and t.first_step == self.first_step]

    def dict_extras(self) -> dict:
        first = None
        if self.first_step is not None:
            at_first = self.differing_at_first_step
            head = at_first[0]
            first = {"step": self.first_step, "rank": None, "reason": head.status, "phase": head.phase,
                     "name": head.name, "occurrence": head.occurrence, "kind": "tensor", "a": head.a, "b": head.b,
                     "detail": head.detail, "records_differing": len(at_first),
                     "tensors": [t.name for t in at_first]}
        return {"exit_code": self.verdict.exit_code, "by": "global", "first_divergence": first}


def _entry(record) -> dict:
    return {"dtype": record.dtype, "shape": list(record.shape or ()),
            "digest": None if record.digest is None else f"{record.digest:016x}"}


class _RunSteps:
    """Every rank's global records of one run, step by step (a merge of the rank streams)."""

    def __init__(self, run: Run, label: str, start: int, stop: int | None):
        self.run, self.label, self.start, self.stop = run, label, start, stop
        self.readers = {rank: run.stream(rank) for rank in run.ranks}
        self.iterators = {rank: reader.steps() for rank, reader in self.readers.items()}
        self.heap: list[tuple[int, int, Any]] = []
        self.incomplete: list[str] = []
        self.num_records = 0
        for rank in self.readers:
            self._advance(rank)

    def _advance(self, rank: int) -> None:
        for block in self.iterators[rank]:
            if block.step < self.start:
                continue
            if self.stop is not None and block.step >= self.stop:
                return
            heapq.heappush(self.heap, (block.step, rank, block))
            return
        reader = self.readers[rank]
        if not reader.closed_cleanly:
            self.incomplete.append(f"run {self.label} rank {rank}: {reader.stop_reason or 'the stream did not close cleanly'}; "
                                   "later steps are unknown")

    def next_step(self) -> int | None:
        return self.heap[0][0] if self.heap else None

    def take(self, step: int) -> tuple[dict, list[str], set]:
        """The global records of ``step`` over all ranks: {(phase, name, occurrence): record},
        what the ranks disagree on (sentences), and the keys they disagree on."""
        found: dict = {}
        by_rank: dict = {}
        disagreements, inconsistent = [], set()
        while self.heap and self.heap[0][0] == step:
            _, rank, block = heapq.heappop(self.heap)
            for record in block.records():
                if record.kind != "tensor" or not record.phase.startswith(GLOBAL_PHASE_PREFIX):
                    continue
                self.num_records += 1
                key = (record.phase[len(GLOBAL_PHASE_PREFIX):], record.name, record.occurrence)
                seen = found.get(key)
                if seen is None:
                    found[key], by_rank[key] = record, rank
                elif not seen.same_content(record):
                    inconsistent.add(key)
                    disagreements.append(
                        f"run {self.label} step {step}: ranks {by_rank[key]} and {rank} recorded different global "
                        f"digests of {key[0]}/{key[1]} ({seen.summary()} vs {record.summary()}): a shard group or "
                        "replica of this run diverged within it")
            self._advance(rank)
        return found, disagreements, inconsistent

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def diff_global(a: str | os.PathLike, b: str | os.PathLike, *, start: int = 0, stop: int | None = None) -> GlobalDiffResult:
    """Compare the global records of runs ``a`` and ``b`` (any world sizes and layouts) over
    ``start <= step < stop``.  Raises `StreamError` for a damaged stream."""
    run_a, run_b = open_run(a), open_run(b)
    require_same_digest_version(run_a, run_b)
    steps_a = steps_b = None
    try:
        steps_a = _RunSteps(run_a, "a", start, stop)
        steps_b = _RunSteps(run_b, "b", start, stop)
        results: dict[tuple, GlobalTensorResult] = {}
        notes = _layout_notes(run_a, run_b)
        steps_compared = 0
        steps_with_records = 0
        resumed = _later_start(steps_a, steps_b)
        if resumed is not None:  # one run resumed the other: the steps before its first are in one run only
            label, first, other = resumed
            earlier = steps_a if label == "b" else steps_b
            while earlier.next_step() is not None and earlier.next_step() < first:
                earlier.take(earlier.next_step())
            notes.append(resumed_note(label, first, other))
        while True:
            step_a, step_b = steps_a.next_step(), steps_b.next_step()
            if step_a is None and step_b is None:
                break
            step = min(s for s in (step_a, step_b) if s is not None)
            records_a, disagree_a, inconsistent_a = steps_a.take(step) if step_a == step else ({}, [], set())
            records_b, disagree_b, inconsistent_b = steps_b.take(step) if step_b == step else ({}, [], set())
            if not records_a and not records_b:
                continue  # a step without global records on either side (local records only)
            steps_with_records += 1
            notes.extend(disagree_a + disagree_b)
            if records_a and records_b:
                steps_compared += 1
            for key in list(records_a) + [k for k in records_b if k not in records_a]:
                _compare(results, key, step, records_a.get(key), records_b.get(key),
                         [label for label, bad in (("a", inconsistent_a), ("b", inconsistent_b)) if key in bad],
                         missing_step="a" if not records_a else "b" if not records_b else None)
        incomplete = steps_a.incomplete + steps_b.incomplete
        compared = {"steps": steps_compared, "tensors": len(results),
                    "records": steps_a.num_records + steps_b.num_records,
                    "ranks_a": len(run_a.ranks), "ranks_b": len(run_b.ranks),
                    "world_size_a": run_a.world_size, "world_size_b": run_b.world_size}
    finally:
        for steps in (steps_a, steps_b):
            if steps is not None:
                steps.close()
    tensors = list(results.values())
    differing = [t for t in tensors if t.status not in ("identical", "shape_only")]
    shape_only = [t for t in tensors if t.status == "shape_only"]
    compared["tensors_shape_only"] = len(shape_only)
    first_step = min((t.first_step for t in differing), default=None)
    window = f"[{start}, {stop if stop is not None else 'end'})"
    if differing:
        verdict = Verdict.DIVERGED
        notes.extend(incomplete)
        incomplete = []
    else:
        if steps_with_records == 0:
            incomplete.append(f"nothing to compare: neither run holds a global record (Recorder.global_tensors) in "
                              f"the window {window}")
        elif steps_compared == 0:
            incomplete.append(f"nothing to compare: the runs hold global records in the window {window}, but at no "
                              "common step")
        if shape_only:
            incomplete.append(f"{len(shape_only)} global tensor(s) were compared by shape and dtype only, never by "
                              f"value: they hold no digest (over max_tensor_bytes when recorded), e.g. "
                              f"{', '.join(t.phase + '/' + t.name for t in shape_only[:5])}. To compare their values, "
                              "record both runs without the cap or with a cap above the largest tensor")
        if resumed is not None and not incomplete:
            incomplete.append(resumed_unjudged(resumed[0], resumed[1]))
        verdict = Verdict.INCOMPLETE if incomplete else Verdict.IDENTICAL
    return GlobalDiffResult(a=str(a), b=str(b), verdict=verdict, first_step=first_step, tensors=tensors,
                            compared=compared, notes=notes, incomplete=incomplete,
                            resumed=None if resumed is None else ResumedWindow(resumed[0], resumed[1]))


def _later_start(steps_a: _RunSteps, steps_b: _RunSteps) -> tuple[str, int, int] | None:
    """When one run's first step in the window comes after the other's (it resumed the other's
    checkpoint), its label, its first step and the other's; else None."""
    first_a, first_b = steps_a.next_step(), steps_b.next_step()
    if first_a is None or first_b is None or first_a == first_b:
        return None
    return ("b", first_b, first_a) if first_b > first_a else ("a", first_a, first_b)


def _compare(results: dict, key: tuple, step: int, rec_a, rec_b, inconsistent: list[str],
             missing_step: str | None) -> None:
    """Fold one step's records of `key` into its result; `inconsistent` names the runs ("a",
    "b") whose ranks disagree on it at this step."""
    result = results.get(key)
    if result is None:
        result = results[key] = GlobalTensorResult(phase=key[0], name=key[1], occurrence=key[2], status="identical",
                                                   first_step=None, steps_compared=0, a=None, b=None)
    if result.status not in ("identical", "shape_only"):
        return  # its first difference is already known
    if rec_a is not None and rec_b is not None:
        result.steps_compared += 1
        result.a, result.b = _entry(rec_a), _entry(rec_b)
        match = record_match(rec_a, rec_b)
        if match == "shape_only" and not inconsistent:
            # no digest on a side (over max_tensor_bytes): the shapes agree, the values are unknown
            result.status, result.first_step = "shape_only", step
            result.detail = (f"compared by shape and dtype only at step {step}: no digest (over the size cap when "
                             f"recorded): a {rec_a.summary()}, b {rec_b.summary()}")
            return
        if match == "equal" and not inconsistent:
            return
        result.status, result.first_step = "differs", step
        if inconsistent:
            result.status = "ranks_disagree"
            runs = " and ".join(f"run {label}" for label in inconsistent)
            result.detail = (f"the ranks of {runs} disagree on its global digest at step {step} (see notes); "
                             f"digest shown: the first rank's")
        elif (rec_a.dtype, rec_a.shape) != (rec_b.dtype, rec_b.shape):
            result.detail = f"global shape/dtype differ: a {rec_a.summary()}, b {rec_b.summary()}"
        else:
            result.detail = f"digests differ: a {rec_a.summary()}, b {rec_b.summary()}"
        return
    present, label = (rec_a, "a") if rec_a is not None else (rec_b, "b")
    other = "b" if label == "a" else "a"
    result.status, result.first_step = f"only_in_{label}", step
    result.a, result.b = (_entry(present), None) if label == "a" else (None, _entry(present))
    result.detail = (f"run {other} has no step {step} with global records" if missing_step == other
                     else f"run {other} records no global {key[0]}/{key[1]} at step {step}")


def _layout_notes(run_a: Run, run_b: Run) -> list[str]:
    """Say what differs between the layouts (expected here: that is why global identity is used)."""
    notes = []
    if run_a.world_size != run_b.world_size:
        notes.append(f"world size: a = {run_a.world_size}, b = {run_b.world_size} (compared by global tensor)")
    config_a, config_b = run_a.header.config, run_b.header.config
    for key in sorted(set(config_a) | set(config_b)):
        if config_a.get(key) != config_b.get(key):
            notes.append(f"config {key!r}: a = {config_a.get(key)!r}, b = {config_b.get(key)!r}")
    return notes


__all__ = ["diff_global", "GlobalDiffResult", "GlobalTensorResult"]
