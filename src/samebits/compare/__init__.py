"""The comparator: are two runs bitwise identical, and if not, where did they first part?

`diff(a, b)` streams both runs rank by rank.  Steps whose roots (and record counts)
agree are skipped without decoding; the first step that differs on a rank is decoded
and its records are matched by identity (kind, phase, name, occurrence), never by
position.  The result is a `DiffResult`, the same object `samebits diff --json` prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from samebits.errors import IncomparableRunsError
from samebits.stream.reader import Record, Run, StreamReader, open_run


@dataclass
class Divergence:
    """The first difference on one rank: a step, and the first differing record in it."""

    step: int
    rank: int
    reason: str  # "content" | "only_in_a" | "only_in_b" | "ended_a" | "ended_b"
    phase: str | None = None
    name: str | None = None
    occurrence: int | None = None
    kind: str | None = None
    a: dict | None = None
    b: dict | None = None
    records_differing: int = 0
    position: int = 0  # index of the first differing record in the step (orders ranks)
    detail: str = ""

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "rank": self.rank,
            "reason": self.reason,
            "phase": self.phase,
            "name": self.name,
            "occurrence": self.occurrence,
            "kind": self.kind,
            "a": self.a,
            "b": self.b,
            "records_differing": self.records_differing,
            "detail": self.detail,
        }


@dataclass
class DiffResult:
    """What `diff` found.  ``verdict`` is "identical" or "diverged"."""

    a: str
    b: str
    verdict: str
    first_divergence: Divergence | None
    ranks_diverged_first: list[int]
    divergences: dict[int, Divergence]  # per rank, its first divergence (if any)
    compared: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"

    def to_json(self) -> dict:
        first = None
        if self.first_divergence is not None:
            first = self.first_divergence.to_json()
            first["ranks"] = self.ranks_diverged_first
        return {
            "verdict": self.verdict,
            "a": self.a,
            "b": self.b,
            "first_divergence": first,
            "divergences_by_rank": {str(r): d.to_json() for r, d in sorted(self.divergences.items())},
            "compared": self.compared,
            "notes": self.notes,
        }


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    start_step: int | None = None,
    stop_step: int | None = None,
    allow_config_diff: bool = False,
    verify: bool = False,
    ignore_config_keys: tuple[str, ...] = (),
) -> DiffResult:
    """Compare run directories ``a`` and ``b`` bit for bit.

    ``start_step``/``stop_step`` restrict the comparison to ``start <= step < stop``
    (e.g. a resumed run from its resume step on).  ``verify`` checksums and decodes every
    step instead of trusting equal step roots.  Raises `IncomparableRunsError` when the
    runs cannot be compared (world size, config, recorded names), `StreamError` when a
    stream is unreadable.
    """
    run_a, run_b = open_run(a), open_run(b)
    notes: list[str] = []
    _check_comparable(run_a, run_b, allow_config_diff, ignore_config_keys, notes)
    ranks = [r for r in run_a.ranks if r in run_b.files]
    window = (start_step or 0, stop_step)
    divergences: dict[int, Divergence] = {}
    counts = {"ranks": len(ranks), "steps": 0, "records": 0, "steps_identical_by_root": 0, "steps_decoded": 0}
    names_checked = allow_config_diff
    bound: int | None = None  # no need to look past the earliest divergence found so far
    for rank in ranks:
        reader_a, reader_b = run_a.stream(rank), run_b.stream(rank)
        found, steps_seen = _compare_rank(rank, reader_a, reader_b, window, bound, verify, counts, names_checked)
        names_checked = True
        counts["steps"] = max(counts["steps"], steps_seen)
        for reader, label in ((reader_a, "a"), (reader_b, "b")):
            if reader.stop_reason and not reader.stop_reason.startswith("ended without"):
                notes.append(f"run {label} rank {rank}: {reader.stop_reason}")
            reader.close()
        if found is not None:
            divergences[rank] = found
            bound = found.step if bound is None else min(bound, found.step)
    notes.extend(_environment_notes(run_a, run_b))
    run_a.close()
    run_b.close()
    first, first_ranks = None, []
    if divergences:
        step = min(d.step for d in divergences.values())
        at_step = [d for d in divergences.values() if d.step == step]
        first = min(at_step, key=lambda d: (d.position, d.rank))
        first_ranks = sorted(d.rank for d in at_step)
    return DiffResult(
        a=str(a),
        b=str(b),
        verdict="diverged" if first else "identical",
        first_divergence=first,
        ranks_diverged_first=first_ranks,
        divergences=divergences,
        compared=counts,
        notes=notes,
    )


def _check_comparable(run_a: Run, run_b: Run, allow: bool, ignore_keys, notes: list[str]) -> None:
    problems = []
    if run_a.world_size != run_b.world_size:
        raise IncomparableRunsError(
            f"cannot compare {run_a.path} (world size {run_a.world_size}) with {run_b.path} "
            f"(world size {run_b.world_size}): a different world size changes reduction orders, "
            "so the bits are expected to differ. Compare runs of the same world size.",
            [f"world size: {run_a.world_size} vs {run_b.world_size}"],
        )
    only_a = sorted(set(run_a.ranks) - set(run_b.ranks))
    only_b = sorted(set(run_b.ranks) - set(run_a.ranks))
    if only_a or only_b:
        line = f"recorded ranks differ: only in a {only_a}, only in b {only_b}"
        if not set(run_a.ranks) & set(run_b.ranks):
            raise IncomparableRunsError(f"cannot compare: {line}; the runs share no rank.", [line])
        notes.append(line + " (compared the ranks both have)")
    config_a, config_b = run_a.header.get("config", {}), run_b.header.get("config", {})
    for key in sorted(set(config_a) | set(config_b)):
        if key in ignore_keys:
            continue
        if key not in config_b:
            problems.append(f"config key {key!r} only in a (= {config_a[key]!r})")
        elif key not in config_a:
            problems.append(f"config key {key!r} only in b (= {config_b[key]!r})")
        elif config_a[key] != config_b[key]:
            problems.append(f"config {key!r}: a = {config_a[key]!r}, b = {config_b[key]!r}")
    if problems:
        if not allow:
            raise IncomparableRunsError(
                f"cannot compare {run_a.path} with {run_b.path}: their configs differ:\n  - "
                + "\n  - ".join(problems)
                + "\nIf the difference is intended (a code or setting change under test), pass "
                "--allow-config-diff (allow_config_diff=True).",
                problems,
            )
        notes.extend(f"allowed: {p}" for p in problems)


def _environment_notes(run_a: Run, run_b: Run) -> list[str]:
    env_a = run_a.header.get("environment", {})
    env_b = run_b.header.get("environment", {})
    notes = []
    for key in sorted(set(env_a) | set(env_b)):
        if key == "env":
            continue
        if env_a.get(key) != env_b.get(key):
            notes.append(f"environment {key}: a = {env_a.get(key)!r}, b = {env_b.get(key)!r}")
    vars_a, vars_b = env_a.get("env", {}), env_b.get("env", {})
    for key in sorted(set(vars_a) | set(vars_b)):
        if key.startswith("SAMEBITS_") or key.startswith("TORCHELASTIC_"):
            continue
        if vars_a.get(key) != vars_b.get(key):
            notes.append(f"environment variable {key}: a = {vars_a.get(key)!r}, b = {vars_b.get(key)!r}")
    return notes


def _compare_rank(rank, reader_a: StreamReader, reader_b: StreamReader, window, bound, verify, counts, names_checked):
    """Walk one rank's two streams in step order; return (first Divergence or None, steps)."""
    start, stop = window
    steps_seen = 0
    if not names_checked:
        _check_names(rank, reader_a.path, reader_b.path, start, stop)
    if not verify:
        identical, first_unequal, steps_seen, records = _compare_indexes(reader_a, reader_b, window, bound)
        counts["steps_identical_by_root"] += steps_seen
        counts["records"] += records
        if identical:
            return None, steps_seen
        start = first_unequal if first_unequal is not None else start
    steps_a, steps_b = reader_a.steps(verify), reader_b.steps(verify)

    def advance(iterator):
        for block in iterator:
            if block.step < start:
                continue
            if stop is not None and block.step >= stop:
                return None
            return block
        return None

    block_a, block_b = advance(steps_a), advance(steps_b)
    while block_a is not None or block_b is not None:
        step = min(b.step for b in (block_a, block_b) if b is not None)
        if bound is not None and step > bound:
            return None, steps_seen
        if block_a is None or block_b is None or block_a.step != block_b.step:
            missing_in = "b" if (block_b is None or (block_a is not None and block_a.step < block_b.step)) else "a"
            present = block_a if missing_in == "b" else block_b
            ended = (block_b if missing_in == "b" else block_a) is None
            reader = reader_b if missing_in == "b" else reader_a
            detail = (
                f"run {missing_in} has no step {step} on rank {rank}: "
                + (f"its stream ends before it ({reader.stop_reason or 'closed cleanly'})" if ended else "the step is missing")
            )
            return Divergence(step=step, rank=rank, reason=f"ended_{missing_in}" if ended else f"only_in_{'a' if missing_in == 'b' else 'b'}",
                              records_differing=present.num_records, detail=detail), steps_seen
        steps_seen += 1
        if not verify and block_a.root == block_b.root and block_a.num_records == block_b.num_records:
            counts["steps_identical_by_root"] += 1
            counts["records"] += block_a.num_records
        else:
            counts["steps_decoded"] += 1
            found = _compare_step(rank, block_a.step, block_a.records(), block_b.records())
            if found is not None:
                return found, steps_seen
            counts["records"] += block_a.num_records
        block_a, block_b = advance(steps_a), advance(steps_b)
    return None, steps_seen


def _compare_indexes(reader_a: StreamReader, reader_b: StreamReader, window, bound):
    """Compare two cleanly closed streams through their step-index footers alone.

    Returns (identical, first unequal step or None, steps equal, records in them).  When
    either stream has no footer nothing is decided: (False, None, 0, 0)."""
    index_a, index_b = reader_a.step_index(), reader_b.step_index()
    if index_a is None or index_b is None:
        return False, None, 0, 0
    start, stop = window

    def selected(index):
        return [e for e in index if e[0] >= start and (stop is None or e[0] < stop)]

    index_a, index_b = selected(index_a), selected(index_b)
    steps = records = 0
    for entry_a, entry_b in zip(index_a, index_b):
        if entry_a[:3] != entry_b[:3]:
            return False, min(entry_a[0], entry_b[0]), steps, records
        if bound is not None and entry_a[0] > bound:
            return True, None, steps, records
        steps += 1
        records += entry_a[1]
    if len(index_a) != len(index_b):
        longer = index_a if len(index_a) > len(index_b) else index_b
        return False, longer[len(index_a if longer is index_b else index_b)][0], steps, records
    return True, None, steps, records


def _check_names(rank: int, path_a, path_b, start: int, stop: int | None) -> None:
    """Refuse runs that record different names: compared at the first step both have."""
    first = {}
    for label, path in (("a", path_a), ("b", path_b)):
        reader = StreamReader(path)
        for block in reader.steps():
            if block.step >= start and (stop is None or block.step < stop):
                first[label] = block
                break
    if len(first) < 2 or first["a"].step != first["b"].step:
        return  # nothing common to check here; the step walk reports missing steps
    block_a, block_b = first["a"], first["b"]
    keys_a = {r.key[:3] for r in block_a.records()}
    keys_b = {r.key[:3] for r in block_b.records()}
    block_a.reader.close()
    block_b.reader.close()
    if keys_a != keys_b:
        only_a = sorted(f"{k[1]}/{k[2]}" for k in keys_a - keys_b)
        only_b = sorted(f"{k[1]}/{k[2]}" for k in keys_b - keys_a)
        lines = []
        if only_a:
            lines.append(f"recorded only in a: {', '.join(only_a[:10])}" + (" ..." if len(only_a) > 10 else ""))
        if only_b:
            lines.append(f"recorded only in b: {', '.join(only_b[:10])}" + (" ..." if len(only_b) > 10 else ""))
        raise IncomparableRunsError(
            f"cannot compare: the runs record different names (rank {rank}, step {block_a.step}):\n  - "
            + "\n  - ".join(lines)
            + "\nRecord the same tensors in both runs, or pass --allow-config-diff to report the "
            "differences as divergences.",
            lines,
        )


def _compare_step(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> Divergence | None:
    by_key_b = {r.key: r for r in records_b}
    keys_a = set()
    first: Divergence | None = None
    differing = 0
    for position, rec_a in enumerate(records_a):
        keys_a.add(rec_a.key)
        rec_b = by_key_b.get(rec_a.key)
        if rec_b is not None and rec_a.same_content(rec_b):
            continue
        differing += 1
        if first is None:
            first = Divergence(
                step=step, rank=rank, reason="content" if rec_b is not None else "only_in_a",
                phase=rec_a.phase, name=rec_a.name, occurrence=rec_a.occurrence, kind=rec_a.kind,
                a=rec_a.to_json(), b=None if rec_b is None else rec_b.to_json(), position=position,
                detail=f"a: {rec_a.summary()}; b: {rec_b.summary() if rec_b else 'no such record'}",
            )
    for position, rec_b in enumerate(records_b):
        if rec_b.key in keys_a:
            continue
        differing += 1
        if first is None:
            first = Divergence(
                step=step, rank=rank, reason="only_in_b", phase=rec_b.phase, name=rec_b.name,
                occurrence=rec_b.occurrence, kind=rec_b.kind, a=None, b=rec_b.to_json(), position=position,
                detail=f"a: no such record; b: {rec_b.summary()}",
            )
    if first is not None:
        first.records_differing = differing
    return first


__all__ = ["diff", "DiffResult", "Divergence"]
