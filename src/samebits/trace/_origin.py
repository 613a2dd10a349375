"""Origin, not symptom: classify the first divergent record of every rank.

Each rank's first differing step is read through `samebits.compare.divergent_steps` (the
comparison engine's one walk), its records matched by (phase, name, occurrence), and the first
differing record classified as origin, receiver, untraced, control_flow or order
(docs/tracing.md, "Origin, not symptom").  Context records (the state census) are never
classified: a step where only they differ is no divergence; they are listed in
``state_differs``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from samebits.compare import RankStep, divergent_steps
from samebits.determinism import lookup_op
from samebits.errors import IncomparableRunsError
from samebits.stream.phases import STATE, TRACE_PHASE_PREFIX, TRAINING_PHASES, training_rank
from samebits.stream.reader import Record, Run, open_run
from samebits.trace._config import CONTEXT_CATEGORIES, ORDER_LABEL, PRE_PHASE, SET_LABEL, parse_record, split_op_id
from samebits.trace._tracer import call_sites_filename
from samebits.verdicts import ToDict, Verdict, serialised


@dataclass
class OriginFinding(ToDict):
    """The first difference of one rank, classified."""

    rank: int
    step: int
    classification: str  # origin | receiver | untraced | control_flow | order
    category: str | None = None  # state | phase | collective | module | op | probe | record
    phase: str | None = None  # training phase (or, for plain records, the record's phase)
    event_id: str | None = None
    module: str | None = None
    op: str | None = None
    role: str | None = None
    label: str | None = None
    record: str | None = None  # "phase/name" of the first differing record
    position: int = 0
    a: Record | None = None  # the first differing record in run a (None: it has none there)
    b: Record | None = None
    from_rank: int | None = None
    call_site: str | None = None
    catalog: str | None = None
    detail: str = ""
    parted: str | None = None  # where the recorded sequences part, when they do (control flow)
    state_differs: list[str] = field(default_factory=list)  # census records that differ at the step's start
    state_unused: list[str] = field(default_factory=list)  # generators that differ but neither run drew from
    permuted: bool = False  # an op's or collective's inputs are the same tensors in another order
    reordered: dict | None = None  # an order finding: {"group": what holds them, "a": labels, "b": labels}

    def sort_key(self) -> tuple:
        if self.category in (None, "record"):
            phase_rank = training_rank(self.phase or "")
        else:
            phase_rank = TRAINING_PHASES.index(self.phase) if self.phase in TRAINING_PHASES else len(TRAINING_PHASES)
        return (self.step, phase_rank, self.position, self.rank)

    def where(self) -> str:
        """One line: rank, step, phase, module, op."""
        parts = [f"rank {self.rank}", f"step {self.step}"]
        if self.phase:
            parts.append(f"phase {self.phase}")
        if self.module is not None:
            parts.append(f"module {self.module or '(root)'}")
        if self.op:
            parts.append(f"op {self.op}")
        if self.event_id and self.category in ("op", "collective", "probe"):
            parts.append(f"id {self.event_id}")
        return ", ".join(parts)


def _by_rank(findings: dict[int, OriginFinding]) -> dict[str, dict]:
    return {str(rank): finding.to_dict() for rank, finding in sorted(findings.items())}


@dataclass
class OriginReport(ToDict):
    dict_keys = ("verdict", "a", "b", "step", "origins", "findings", "notes")

    a: str
    b: str
    verdict: Verdict  # IDENTICAL, DIVERGED, or INCOMPLETE when no step was compared
    step: int | None
    findings: dict[int, OriginFinding] = field(metadata=serialised(convert=_by_rank))
    origins: list[OriginFinding]
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"

    @property
    def first(self) -> OriginFinding | None:
        """The earliest origin; without one, the earliest finding of any kind."""
        if self.origins:
            return self.origins[0]
        ordered = sorted(self.findings.values(), key=OriginFinding.sort_key)
        return ordered[0] if ordered else None

    @property
    def control_flow(self) -> OriginFinding | None:
        parted = [f for f in self.findings.values() if f.classification == "control_flow"]
        return min(parted, key=OriginFinding.sort_key) if parted else None


class _Runs:
    """The two runs, the steps `divergent_steps` decoded, and the call-site files, read once."""

    def __init__(self, a, b):
        self.paths = (Path(a), Path(b))
        self.run_a, self.run_b = open_run(a), open_run(b)
        self.decoded: dict[tuple[int, int], RankStep] = {}  # (rank, step) -> both sides' records
        self.first_step: dict[int, int] = {}  # rank -> its first divergent step (any record)
        self._read: dict[tuple[int, int], tuple | None] = {}
        self._sites: dict[tuple[int, int], dict] = {}

    def close(self) -> None:
        self.run_a.close()
        self.run_b.close()

    def divergent(self, start: int | None, stop: int | None, only: set[int]):
        """`divergent_steps` over the window, keeping what it decoded (of ranks ``only``)."""
        for found in divergent_steps(self.run_a, self.run_b, start_step=start, stop_step=stop):
            self.first_step.setdefault(found.rank, found.step)
            self.decoded[(found.rank, found.step)] = found
            if found.rank in only:
                yield found

    def records_at(self, rank: int, step: int) -> tuple[list[Record], list[Record]] | None:
        """Both runs' records of ``rank`` at ``step``, or None when they are equal there or a
        run lacks that step.  A rank whose first divergence comes later holds equal records
        (the step roots matched); a step already decoded is reused; otherwise that one step is
        read (once per rank and step)."""
        found = self.decoded.get((rank, step))
        if found is not None:
            return None if found.missing else (found.records_a, found.records_b)
        first = self.first_step.get(rank)
        if first is None or first > step:
            return None
        key = (rank, step)
        if key not in self._read:
            sides = [_read_step(run, rank, step) for run in (self.run_a, self.run_b)]
            self._read[key] = None if None in sides else (sides[0], sides[1])
        return self._read[key]

    def call_site(self, rank: int, step: int, phase: str, event_id: str) -> str | None:
        for side, path in enumerate(self.paths):
            if (side, rank) not in self._sites:
                try:
                    self._sites[(side, rank)] = json.loads(
                        (path / call_sites_filename(rank)).read_text()).get("steps", {})
                except (OSError, ValueError):
                    self._sites[(side, rank)] = {}
            site = self._sites[(side, rank)].get(str(step), {}).get(f"{phase}|{event_id}")
            if site:
                return site
        return None


def _read_step(run: Run, rank: int, step: int) -> list[Record] | None:
    if rank not in run.files:
        return None
    reader = run.stream(rank)
    try:
        for block in reader.steps():
            if block.step == step:
                return block.records()
            if block.step > step:
                return None
        return None
    finally:
        reader.close()


def find_origins(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
                 ranks=None, resume_step: int | None = None) -> OriginReport:
    """Classify the first divergent record of every rank of runs `a` and `b`.

    ``step``: only that step.  ``resume_step`` K: b resumed a's checkpoint at K, so step K's
    records of training phase ``pre`` are not compared (a's tail of step K-1, b's start-up);
    the tracer records again, at first use, anything "pre" made.  Raises
    `IncomparableRunsError` for different world sizes.
    """
    runs = _Runs(a, b)
    try:
        return _find_origins(runs, a, b, step, ranks, resume_step)
    finally:
        runs.close()


def _find_origins(runs: _Runs, a, b, step: int | None, ranks, resume_step: int | None = None) -> OriginReport:
    run_a, run_b = runs.run_a, runs.run_b
    if run_a.world_size != run_b.world_size:
        raise IncomparableRunsError(
            f"cannot trace {a} (world size {run_a.world_size}) against {b} (world size "
            f"{run_b.world_size}): collectives would not line up. Compare runs of one world size.")
    notes = []
    common = [r for r in run_a.ranks if r in run_b.files]
    if ranks is not None:
        common = [r for r in common if r in set(ranks)]
    missing = sorted(set(run_a.ranks) ^ set(run_b.ranks))
    if missing:
        notes.append(f"ranks recorded in only one run (not compared): {missing}")
    stop = None if step is None else step + 1
    findings: dict[int, OriginFinding] = {}
    wanted, start = set(common), step
    while wanted:
        # A step where only context (the state census) differs is no divergence: such ranks
        # go on from their next step.  (`divergent_steps` yields a rank's first divergent
        # step only, so that rare continuation is a second walk, from that step on.)
        again: dict[int, int] = {}
        for found in runs.divergent(start, stop, wanted):
            if found.missing:
                findings[found.rank] = OriginFinding(found.rank, found.step, "control_flow",
                                                     detail=_missing_detail(found))
                continue
            records_a, records_b = found.records_a, found.records_b
            if found.step == resume_step:
                records_a, records_b, dropped = _drop_pre(records_a), _drop_pre(records_b), (records_a, records_b)
                counts = [len(dropped[0]) - len(records_a), len(dropped[1]) - len(records_b)]
                if any(counts) and not any(f"step {found.step}, rank {found.rank}:" in n for n in notes):
                    notes.append(f"step {found.step}, rank {found.rank}: b resumed here, so the records of phase "
                                 f"pre (before the step's first forward, backward or optimizer step) are not "
                                 f"compared: a's {counts[0]} (the tail of step {found.step - 1}, e.g. logging "
                                 f"after its optimizer step), b's {counts[1]} (its start-up)")
            finding = _classify_step(found.rank, found.step, records_a, records_b)
            if finding is not None:
                findings[found.rank] = finding
            elif stop is None:
                again[found.rank] = found.step + 1
        wanted, start = set(again), min(again.values(), default=None)
    for finding in findings.values():
        _annotate(finding, runs)
    origins = sorted((f for f in findings.values() if f.classification == "origin"), key=OriginFinding.sort_key)
    first_step = min((f.step for f in findings.values()), default=None)
    verdict = Verdict.DIVERGED if findings else Verdict.IDENTICAL
    if not findings and not runs.first_step and not any(_has_step(run_a, rank, step) for rank in common):
        verdict = Verdict.INCOMPLETE  # identical is proof that something was compared
        notes.append(f"nothing was compared: no rank of {a} recorded "
                     + ("any step" if step is None else f"step {step}") + " that both runs have")
    return OriginReport(str(a), str(b), verdict, first_step, findings, origins, notes)


def _drop_pre(records: list[Record]) -> list[Record]:
    """The records of a step without those of training phase ``pre``."""
    return [r for r in records if not (r.phase.startswith(TRACE_PHASE_PREFIX) and r.phase.endswith(":" + PRE_PHASE))]


def _missing_detail(found: RankStep) -> str:
    return (f"run {found.missing} has no step {found.step} on rank {found.rank} ({found.detail}): the runs part "
            "in control flow (a crash, an early exit, or a different number of steps)")


def _has_step(run: Run, rank: int, step: int | None) -> bool:
    """Does ``rank``'s stream hold ``step`` (any step for None)?  Its footer's index, else its steps."""
    reader = run.stream(rank)
    try:
        index = reader.step_index()
        if index is not None:
            return any(step is None or entry[0] == step for entry in index)
        return any(step is None or block.step == step for block in reader.steps())
    finally:
        reader.close()


def is_context(record: Record) -> bool:
    """A record observed at a step's start (the state census), not an event of the step."""
    if record.phase == STATE:
        return True
    ref = parse_record(record.phase, record.name)
    return ref is not None and ref.category in CONTEXT_CATEGORIES


def _classify_step(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> OriginFinding | None:
    """The step's first difference, classified; None when only context records differ.
    ``state_differs`` holds the census records both runs took whose contents differ; one that
    only one run took is no evidence of a differing value (a resumed process has not seen its
    optimizer step yet when the tracer takes its first census)."""
    context_b = {r.key: r for r in records_b if is_context(r)}
    state_differs = []
    for record in records_a:
        if is_context(record):
            other = context_b.get(record.key)
            if other is not None and not record.same_content(other) and _label_of(record) not in state_differs:
                state_differs.append(_label_of(record))
    records_a = [r for r in records_a if not is_context(r)]
    records_b = [r for r in records_b if not is_context(r)]
    finding = _classify_events(rank, step, records_a, records_b)
    if finding is not None:
        finding.state_differs = state_differs
    return finding


def _classify_events(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> OriginFinding | None:
    keys_a = [r.key for r in records_a]
    keys_b = [r.key for r in records_b]
    if set(keys_a) != set(keys_b):
        parted = next((p for p, (ka, kb) in enumerate(zip(keys_a, keys_b)) if ka != kb), min(len(keys_a), len(keys_b)))
        parting = _control_flow(rank, step, parted, records_a, records_b)
        for position in range(parted):  # a value that differs first may be what changed the flow
            ra, rb = records_a[position], records_b[position]
            if not ra.same_content(rb) and ra.phase.startswith(TRACE_PHASE_PREFIX):
                finding = _traced_content(rank, step, position, ra, rb, records_a, records_b)
                finding.parted = parting.detail
                return finding
        parting.parted = parting.detail
        return parting
    by_key_b = {r.key: r for r in records_b}
    first_plain = None
    for position, ra in enumerate(records_a):
        rb = by_key_b[ra.key]
        if not ra.same_content(rb):
            if ra.phase.startswith(TRACE_PHASE_PREFIX):
                return _traced_content(rank, step, position, ra, rb, records_a, records_b)
            if first_plain is None:
                first_plain = (position, ra, rb)
    if first_plain is not None:
        return _content(rank, step, *first_plain)
    if keys_a == keys_b:
        return None
    return _reordered(rank, step, records_a, records_b)


def _traced_content(rank, step, position, ra: Record, rb: Record, records_a: list[Record],
                    records_b: list[Record]) -> OriginFinding:
    """A traced record whose value differs, classified; an input is checked for a permutation."""
    finding = _content(rank, step, position, ra, rb)
    if finding.category == "collective" and finding.role == "in":
        _check_permuted_collectives(finding, ra, records_a, records_b)
    elif finding.category in ("op", "probe") and finding.role == "in":
        _check_permuted_inputs(finding, ra, records_a, records_b)
    return finding


def _group_of(record: Record) -> str:
    """What a record belongs to, for saying what was reordered: its event (traced records) or
    its phase (ordinary records, e.g. zero-code recording's ``grads``)."""
    ref = parse_record(record.phase, record.name)
    if ref is None:
        return f"records {record.phase}"
    return f"{ref.category} {ref.event_id} ({ref.training_phase}, {ref.role})"


def _label_of(record: Record) -> str:
    ref = parse_record(record.phase, record.name)
    return record.name if ref is None else ref.label


def _reordered(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> OriginFinding:
    """The same records with the same values, in another order: where the order first differs,
    and what holds them (an event's tensors, or a phase), with both orders of its labels."""
    position = next(p for p, (ra, rb) in enumerate(zip(records_a, records_b)) if ra.key != rb.key)
    first = records_a[position]
    finding = _fields(rank, step, "order", position, first)
    finding.a, finding.b = first, records_b[position]
    group = _group_of(first)
    labels_a = [_label_of(r) for r in records_a if _group_of(r) == group]
    labels_b = [_label_of(r) for r in records_b if _group_of(r) == group]
    if labels_a != labels_b:
        finding.reordered = {"group": group, "a": labels_a, "b": labels_b}
        finding.detail = (f"the same records with the same values, in another order: {group} holds the same "
                          f"{len(labels_a)} tensors in another order (a: {_some(labels_a)}; b: {_some(labels_b)})")
    else:  # the groups themselves come in another order (hooks or threads ran in another order)
        finding.detail = (f"the same records with the same values, in another order: at record #{position} a has "
                          f"{describe_record(first)}, b has {describe_record(records_b[position])}")
    return finding


def _some(labels: list[str], n: int = 4) -> str:
    return ", ".join(labels[:n]) + (f", ... ({len(labels)})" if len(labels) > n else "")


def _contents(records: list[Record]) -> list:
    return sorted((repr(r.digest), bytes(r.raw or b""), str(r.dtype), repr(r.shape)) for r in records)


def _check_permuted_inputs(finding: OriginFinding, first: Record, records_a: list[Record],
                           records_b: list[Record]) -> None:
    """An op whose inputs differ by position but are the same tensors in another order (a
    ``torch.cat`` over a Python set): the order it was given them in changes between runs."""
    prefix = f"{finding.event_id}|in:"
    label = finding.label or ""
    if label.endswith((ORDER_LABEL, SET_LABEL)):
        _check_list_provenance(finding, first, records_a, records_b)
        return

    def inputs(records):
        return [r for r in records if r.phase == first.phase and r.name.startswith(prefix)
                and not r.name.endswith((ORDER_LABEL, SET_LABEL))]

    in_a, in_b = inputs(records_a), inputs(records_b)
    if len(in_a) > 1 and _contents(in_a) == _contents(in_b):
        finding.permuted = True
        finding.detail = (f"the {len(in_a)} inputs of {finding.event_id} are the same tensors in both runs, in "
                          "another order: the order it is given them in changes between runs")


def _check_list_provenance(finding: OriginFinding, first: Record, records_a: list[Record],
                           records_b: list[Record]) -> None:
    """The first difference is a list argument's provenance (`_ops._provenance`): the tensors
    it holds were recorded before, with equal values, but the op got them in another order
    (``@order`` differs, ``@set`` matched) or got other ones (``@set`` differs)."""
    label = finding.label or ""
    head = label[: -len(ORDER_LABEL)] if label.endswith(ORDER_LABEL) else label[: -len(SET_LABEL)]
    count = first.shape[0] if first.shape else 0
    where = f"list argument {head} of {finding.event_id}"
    if label.endswith(ORDER_LABEL):
        name = first.name[: -len(ORDER_LABEL)] + SET_LABEL
        set_a, set_b = (next((r for r in records if r.phase == first.phase and r.name == name), None)
                        for records in (records_a, records_b))
        if set_a is not None and set_b is not None and set_a.same_content(set_b):
            finding.permuted = True
            finding.detail = (f"{where} holds the same {count} tensors as in the other run (recorded before it, "
                              "with equal values), in another order: the order it is given them in changes "
                              "between runs")
            return
    finding.detail = (f"{where} holds other tensors than in the other run (the {count} tensors recorded before it "
                      "have equal values, but others of them are passed)")


def _check_permuted_collectives(finding: OriginFinding, first: Record, records_a: list[Record],
                                records_b: list[Record]) -> None:
    """A collective whose input differs while its group's inputs in the step are the same tensors
    in another order: the calls are issued in an order that changes (a Python set)."""
    group = (finding.event_id or "").partition("/")[0]

    def inputs(records):
        return [r for r in records if r.phase == first.phase and "|in:" in r.name
                and r.name.partition("/")[0] == group]

    in_a, in_b = inputs(records_a), inputs(records_b)
    if len(in_a) > 1 and _contents(in_a) == _contents(in_b):
        finding.permuted = True
        finding.detail = (f"{finding.event_id}'s input {finding.label} differs, but the {len(in_a)} inputs of group "
                          f"{group}'s collectives in this phase are the same tensors in another order: the "
                          "collectives are issued in an order that changes between runs")


def describe_record(record: Record | None) -> str:
    """A record for a sentence: a traced one by its event (category, id, training phase, role
    and label), an ordinary one by phase/name; None (a step whose records end first) says so."""
    if record is None:
        return "(nothing: the stream ends)"
    ref = parse_record(record.phase, record.name)
    if ref is None:
        return f"record {record.phase}/{record.name}"
    return f"{ref.category} {ref.event_id} ({ref.training_phase}, {ref.role} {ref.label})"


def _control_flow(rank, step, position, records_a, records_b) -> OriginFinding:
    ra = records_a[position] if position < len(records_a) else None
    rb = records_b[position] if position < len(records_b) else None
    previous = records_a[position - 1] if position > 0 else None
    finding = _fields(rank, step, "control_flow", position, ra or rb)
    finding.detail = (f"the recorded sequences part at record #{position} of step {step}: a has "
                      f"{describe_record(ra)}, b has {describe_record(rb)}; last common record: "
                      f"{describe_record(previous) if previous else '(none: the step starts differently)'}")
    finding.a, finding.b = ra, rb
    return finding


def _content(rank, step, position, ra: Record, rb: Record) -> OriginFinding:
    ref = parse_record(ra.phase, ra.name)
    classification = "untraced" if ref is None else "receiver" if ref.role == "in" else "origin"
    finding = _fields(rank, step, classification, position, ra)
    finding.a, finding.b = ra, rb
    if classification == "untraced":
        finding.detail = (f"first difference is the ordinary record {ra.phase}/{ra.name}: no trace records "
                          "before it differ (trace this step at a higher rung to see inputs)")
    elif classification == "receiver":
        finding.detail = (f"input {ref.label} of {ref.event_id} already differed: the difference arose before "
                          "it, in code the trace did not cover")
    else:
        finding.detail = f"all inputs of {ref.event_id} matched; its output {ref.label} differs"
    return finding


def _fields(rank, step, classification, position, record: Record | None) -> OriginFinding:
    finding = OriginFinding(rank, step, classification, position=position)
    if record is None:
        return finding
    finding.record = f"{record.phase}/{record.name}"
    ref = parse_record(record.phase, record.name)
    if ref is None:
        finding.category, finding.phase = "record", record.phase
        return finding
    finding.category, finding.phase, finding.event_id = ref.category, ref.training_phase, ref.event_id
    finding.role, finding.label = ref.role, ref.label
    if ref.category in ("op", "probe"):
        finding.module, finding.op, _ = split_op_id(ref.event_id)
    elif ref.category == "collective":
        finding.op = split_op_id(ref.event_id)[1]
    elif ref.category == "module":
        if ref.event_id.endswith("@grad"):
            finding.module = ref.event_id[: -len("@grad")].rpartition(".")[0]
        else:
            finding.module = ref.event_id.rpartition(":")[0]
    elif ref.category == "state":
        finding.module = ref.label.rpartition(".")[0]
    return finding


def _annotate(finding: OriginFinding, runs: _Runs) -> None:
    if finding.category == "collective" and finding.classification == "origin":
        _check_collective_inputs(finding, runs)
    if finding.event_id and (finding.category in ("op", "probe", "collective") or (
            finding.category == "phase" and finding.event_id.startswith(("reduce:", "optimizer:")))):
        # (an optimizer's phase events: where it was built, else where its step() was called)
        finding.call_site = runs.call_site(finding.rank, finding.step, finding.phase, finding.event_id)
    if finding.category == "op" and finding.op:
        finding.catalog = _catalog_line(finding.op)


def _check_collective_inputs(finding: OriginFinding, runs: _Runs) -> None:
    """A collective is an origin only if its inputs matched on every rank."""
    phase = f"trace:collective:{finding.phase}"
    prefix = finding.event_id + "|in:"
    for rank in runs.run_a.ranks:
        if rank == finding.rank:
            continue
        both = runs.records_at(rank, finding.step)
        if both is None:
            continue
        records_a, records_b = both
        inputs_b = {r.key: r for r in records_b if r.phase == phase and r.name.startswith(prefix)}
        for record in records_a:
            if record.phase == phase and record.name.startswith(prefix):
                other = inputs_b.get(record.key)
                if other is None or not record.same_content(other):
                    finding.classification = "receiver"
                    finding.from_rank = rank
                    finding.detail = (f"{finding.event_id}: inputs matched here but rank {rank}'s input "
                                      f"{record.name.rpartition('|in:')[2]} differed; this rank received it")
                    return
    finding.detail = (f"{finding.event_id}: inputs matched on every rank; the output {finding.label} differs "
                      "(the collective itself is the origin)")


def _catalog_line(op: str) -> str | None:
    try:
        entries = lookup_op(op)
    except Exception:
        return None
    return entries[0].summary() if entries else None


@dataclass
class ReplicaMismatch(ToDict):
    """Parameters that every rank treats as a replica (their reduced gradients are the same
    bits on every rank) but that hold different values across ranks before the first step."""

    step: int
    ranks: list[int]
    params: list[str]


def find_replica_mismatch(run: str | os.PathLike) -> ReplicaMismatch | None:
    """Within one traced run: the parameters whose gradient at the first traced optimizer step
    is equal on every rank (data-parallel replicas; shards get different gradients) while their
    values before that step differ between ranks."""
    opened = open_run(run)
    try:
        return _replica_mismatch(opened)
    finally:
        opened.close()


def _replica_mismatch(run: Run) -> ReplicaMismatch | None:
    ranks = list(run.ranks)
    if len(ranks) < 2:
        return None
    first = None
    params: dict[int, dict[str, Record]] = {}
    grads: dict[int, dict[str, Record]] = {}
    for rank in ranks:
        reader = run.stream(rank)
        try:
            block = next(iter(reader.steps()), None)
            records = block.records() if block is not None else []
            step = block.step if block is not None else None
        finally:
            reader.close()
        if step is None or (first is not None and step != first):
            return None
        first = step
        params[rank], grads[rank] = {}, {}
        for record in records:
            ref = parse_record(record.phase, record.name)
            if ref is None or ref.role != "out":
                continue
            if ref.category == "state" and ref.event_id == "params":
                params[rank].setdefault(ref.label, record)
            elif ref.category == "phase" and ref.training_phase == "reduce":
                grads[rank].setdefault(ref.label, record)
    base = ranks[0]
    mismatched, differing_ranks = [], set()
    for name, value in params[base].items():
        if not all(name in params[r] and name in grads[r] for r in ranks) or name not in grads[base]:
            continue
        if not all(grads[r][name].same_content(grads[base][name]) for r in ranks):
            continue  # not reduced over these ranks: a shard, not a replica
        others = [r for r in ranks if not params[r][name].same_content(value)]
        if others:
            mismatched.append(name)
            differing_ranks.update(others)
    if not mismatched:
        return None
    return ReplicaMismatch(first, sorted({base, *differing_ranks}), mismatched)
