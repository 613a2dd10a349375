"""Origin, not symptom: classify the first divergent record of every rank.

For each rank, the first step whose records differ is decoded and its records are matched
by identity (phase, name, occurrence).  The first differing record R (in execution order)
is then classified from the trace's record names (``<event>|in:..`` / ``<event>|out:..``):

* ``origin``   R is an output of its event and every earlier record matched, so all of
  the event's inputs matched (each tensor version is recorded once, before or at its first
  use).  For a collective the inputs of *every* rank of the step must match as well; if
  another rank's input already differed, this rank merely received the difference.
* ``receiver`` R is an input: the value already differed when it arrived, from untraced code
  before it on this rank, or (collectives) from another rank (``from_rank``).
* ``untraced`` R is an ordinary record (not written by the tracer): no inputs are known.
  Ordinary records are observations, not events: when any traced record of the step
  differs, the first differing *traced* record is classified instead.
* ``control_flow`` the two runs recorded different events: the op sequences part here.
  When a traced value differs *before* that point, that value is classified instead (a
  difference in data often causes the different flow, e.g. MoE routing) and ``parted``
  still says where the sequences part.
* ``order``    same records, same values, different order (e.g. hooks firing in another order).

Context records (the state census, ``trace:census:*`` or a loop's own ``state`` phase) are
never classified: a step where only they differ is not a divergence.  Each finding lists
the census records that differ in its step (``state_differs``), and a receiver whose event's
inputs (an op's, or a process group's collectives') are the same tensors in another order
is marked ``permuted``.

`find_origins` returns every rank's finding and the origins, earliest first.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from samebits.determinism import lookup_op
from samebits.errors import IncomparableRunsError
from samebits.verdicts import Verdict
from samebits.stream.reader import Record, open_run
from samebits.trace._config import (CONTEXT_CATEGORIES, PHASE_PREFIX, STATE_RECORD_PHASE, TRAINING_PHASES,
                                    parse_record, split_op_id)
from samebits.trace._tracer import call_sites_filename

_PLAIN_PHASE_ORDER = {"data": 1, "forward": 1, "metrics": 4, "grads": 4, "params": 5, "optimizer": 5}


@dataclass
class Finding:
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
    a: dict | None = None
    b: dict | None = None
    from_rank: int | None = None
    call_site: str | None = None
    catalog: str | None = None
    detail: str = ""
    parted: str | None = None  # where the recorded sequences part, when they do (control flow)
    state_differs: list[str] = field(default_factory=list)  # census records that differ at the step's start
    permuted: bool = False  # a collective input: the group's inputs are the same tensors in another order

    def sort_key(self) -> tuple:
        if self.category in (None, "record"):
            phase_rank = _PLAIN_PHASE_ORDER.get(self.phase or "", len(TRAINING_PHASES))
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

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class OriginReport:
    a: str
    b: str
    verdict: Verdict  # IDENTICAL, DIVERGED, or INCOMPLETE when no step was compared
    step: int | None
    findings: dict[int, Finding]
    origins: list[Finding]
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.verdict == "identical"

    @property
    def first(self) -> Finding | None:
        """The earliest origin; without one, the earliest finding of any kind."""
        if self.origins:
            return self.origins[0]
        ordered = sorted(self.findings.values(), key=Finding.sort_key)
        return ordered[0] if ordered else None

    @property
    def control_flow(self) -> Finding | None:
        parted = [f for f in self.findings.values() if f.classification == "control_flow"]
        return min(parted, key=Finding.sort_key) if parted else None

    def to_json(self) -> dict:
        return {
            "verdict": str(self.verdict), "a": self.a, "b": self.b, "step": self.step,
            "origins": [f.to_json() for f in self.origins],
            "findings": {str(r): f.to_json() for r, f in sorted(self.findings.items())},
            "notes": self.notes,
        }


class _Side:
    """One run, with its decoded steps cached per rank."""

    def __init__(self, path):
        self.path = Path(path)
        self.run = open_run(path)
        self._cache: dict[tuple[int, int], list[Record] | None] = {}
        self._sites: dict[int, dict] = {}

    def records(self, rank: int, step: int) -> list[Record] | None:
        key = (rank, step)
        if key not in self._cache:
            found = None
            if rank in self.run.files:
                reader = self.run.stream(rank)
                for block in reader.steps():
                    if block.step == step:
                        found = block.records()
                        break
                    if block.step > step:
                        break
                reader.close()
            self._cache[key] = found
        return self._cache[key]

    def call_site(self, rank: int, step: int, phase: str, event_id: str) -> str | None:
        if rank not in self._sites:
            path = self.path / call_sites_filename(rank)
            try:
                self._sites[rank] = json.loads(path.read_text()).get("steps", {})
            except (OSError, ValueError):
                self._sites[rank] = {}
        return self._sites[rank].get(str(step), {}).get(f"{phase}|{event_id}")


def find_origins(a: str | os.PathLike, b: str | os.PathLike, *, step: int | None = None,
                 ranks=None) -> OriginReport:
    """Classify the first divergent record of every rank of runs `a` and `b`.

    ``step``: look only at that step (a narrowed re-run traces one step); otherwise each
    rank's first differing step.  Raises `IncomparableRunsError` for different world sizes.
    """
    side_a, side_b = _Side(a), _Side(b)
    if side_a.run.world_size != side_b.run.world_size:
        raise IncomparableRunsError(
            f"cannot trace {a} (world size {side_a.run.world_size}) against {b} (world size "
            f"{side_b.run.world_size}): collectives would not line up. Compare runs of one world size.")
    notes = []
    common = [r for r in side_a.run.ranks if r in side_b.run.files]
    if ranks is not None:
        common = [r for r in common if r in set(ranks)]
    missing = sorted(set(side_a.run.ranks) ^ set(side_b.run.ranks))
    if missing:
        notes.append(f"ranks recorded in only one run (not compared): {missing}")
    findings: dict[int, Finding] = {}
    for rank in common:
        for at_step, records_a, records_b, ended in _divergent_steps(side_a, side_b, rank, step):
            if ended:
                findings[rank] = Finding(rank, at_step, "control_flow", detail=ended)
                break
            finding = _classify_step(rank, at_step, records_a, records_b)
            if finding is not None:  # None: only context (the state census) differs in that step
                findings[rank] = finding
                break
    for finding in findings.values():
        _annotate(finding, side_a, side_b)
    origins = sorted((f for f in findings.values() if f.classification == "origin"), key=Finding.sort_key)
    first_step = min((f.step for f in findings.values()), default=None)
    verdict = Verdict.DIVERGED if findings else Verdict.IDENTICAL
    if not findings and not any(_has_step(side_a, rank, step) for rank in common):
        verdict = Verdict.INCOMPLETE  # identical is proof that something was compared
        notes.append(f"nothing was compared: no rank of {a} recorded "
                     + ("any step" if step is None else f"step {step}") + " that both runs have")
    return OriginReport(str(a), str(b), verdict, first_step, findings, origins, notes)


def _has_step(side: _Side, rank: int, step: int | None) -> bool:
    reader = side.run.stream(rank)
    try:
        return any(step is None or block.step == step for block in reader.steps())
    finally:
        reader.close()


def _divergent_steps(side_a: _Side, side_b: _Side, rank: int, only_step: int | None):
    """Yield (step, records a, records b, ended-detail) for each of the rank's differing steps,
    in order (a step whose streams part ends the sequence)."""
    reader_a, reader_b = side_a.run.stream(rank), side_b.run.stream(rank)
    try:
        steps_a, steps_b = reader_a.steps(), reader_b.steps()
        block_a, block_b = next(steps_a, None), next(steps_b, None)
        while block_a is not None or block_b is not None:
            if only_step is not None:
                while block_a is not None and block_a.step < only_step:
                    block_a = next(steps_a, None)
                while block_b is not None and block_b.step < only_step:
                    block_b = next(steps_b, None)
                if (block_a is None or block_a.step > only_step) and (block_b is None or block_b.step > only_step):
                    return
            if block_a is None or block_b is None or block_a.step != block_b.step:
                lacking = "b" if block_b is None or (block_a is not None and block_a.step < block_b.step) else "a"
                present = block_a if lacking == "b" else block_b
                reader = reader_b if lacking == "b" else reader_a
                yield (present.step, None, None,
                       f"run {lacking} has no step {present.step} on rank {rank} "
                       f"({reader.stop_reason or 'its stream skips it'}): the runs part in control flow "
                       "(a crash, an early exit, or a different number of steps)")
                return
            if block_a.root != block_b.root or block_a.num_records != block_b.num_records:
                yield block_a.step, block_a.records(), block_b.records(), None
            if only_step is not None:
                return
            block_a, block_b = next(steps_a, None), next(steps_b, None)
    finally:
        reader_a.close()
        reader_b.close()


def is_context(record: Record) -> bool:
    """A record observed at a step's start (the state census), not an event of the step."""
    if record.phase == STATE_RECORD_PHASE:
        return True
    ref = parse_record(record.phase, record.name)
    return ref is not None and ref.category in CONTEXT_CATEGORIES


def _context_name(record: Record) -> str:
    ref = parse_record(record.phase, record.name)
    return record.name if ref is None else ref.label


def _classify_step(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> Finding | None:
    """The step's first difference, classified; None when only context records differ."""
    context_b = {r.key: r for r in records_b if is_context(r)}
    state_differs = []
    for record in records_a:
        if is_context(record):
            other = context_b.get(record.key)
            if (other is None or not record.same_content(other)) and _context_name(record) not in state_differs:
                state_differs.append(_context_name(record))
    records_a = [r for r in records_a if not is_context(r)]
    records_b = [r for r in records_b if not is_context(r)]
    finding = _classify_events(rank, step, records_a, records_b)
    if finding is not None:
        finding.state_differs = state_differs
    return finding


def _classify_events(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> Finding | None:
    keys_a = [r.key for r in records_a]
    keys_b = [r.key for r in records_b]
    if set(keys_a) != set(keys_b):
        parted = next((p for p, (ka, kb) in enumerate(zip(keys_a, keys_b)) if ka != kb), min(len(keys_a), len(keys_b)))
        parting = _control_flow(rank, step, parted, records_a, records_b)
        for position in range(parted):  # a value that differs first may be what changed the flow
            ra, rb = records_a[position], records_b[position]
            if not ra.same_content(rb) and ra.phase.startswith(PHASE_PREFIX):
                finding = _content(rank, step, position, ra, rb)
                finding.parted = parting.detail
                return finding
        parting.parted = parting.detail
        return parting
    by_key_b = {r.key: r for r in records_b}
    first_plain = None
    for position, ra in enumerate(records_a):
        rb = by_key_b[ra.key]
        if not ra.same_content(rb):
            if ra.phase.startswith(PHASE_PREFIX):
                finding = _content(rank, step, position, ra, rb)
                if finding.category == "collective" and finding.role == "in":
                    _check_permuted_collectives(finding, ra, records_a, records_b)
                elif finding.category in ("op", "probe") and finding.role == "in":
                    _check_permuted_inputs(finding, ra, records_a, records_b)
                return finding
            if first_plain is None:
                first_plain = (position, ra, rb)
    if first_plain is not None:
        return _content(rank, step, *first_plain)
    if keys_a == keys_b:
        return None
    return Finding(rank, step, "order", detail="the same records with the same values, in a different order "
                   "(hooks or threads ran in another order)")


def _contents(records: list[Record]) -> list:
    return sorted((repr(r.digest), bytes(r.raw or b""), str(r.dtype), repr(r.shape)) for r in records)


def _check_permuted_inputs(finding: Finding, first: Record, records_a: list[Record],
                           records_b: list[Record]) -> None:
    """An op whose inputs differ by position but are the same tensors in another order (a
    ``torch.cat`` over a Python set): the order it was given them in changes between runs."""
    prefix = f"{finding.event_id}|in:"

    def inputs(records):
        return [r for r in records if r.phase == first.phase and r.name.startswith(prefix)]

    in_a, in_b = inputs(records_a), inputs(records_b)
    if len(in_a) > 1 and _contents(in_a) == _contents(in_b):
        finding.permuted = True
        finding.detail = (f"the {len(in_a)} inputs of {finding.event_id} are the same tensors in both runs, in "
                          "another order: the order it is given them in changes between runs")


def _check_permuted_collectives(finding: Finding, first: Record, records_a: list[Record],
                                records_b: list[Record]) -> None:
    """A collective whose input differs, while the group's collective inputs of the step hold
    the same tensors in both runs, only in another order: the calls are issued in an order
    that changes between runs (a Python set, PYTHONHASHSEED)."""
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


def _describe(record: Record | None) -> str:
    if record is None:
        return "(nothing: the stream ends)"
    ref = parse_record(record.phase, record.name)
    if ref is None:
        return f"record {record.phase}/{record.name}"
    return f"{ref.category} {ref.event_id} ({ref.training_phase}, {ref.role} {ref.label})"


def _control_flow(rank, step, position, records_a, records_b) -> Finding:
    ra = records_a[position] if position < len(records_a) else None
    rb = records_b[position] if position < len(records_b) else None
    previous = records_a[position - 1] if position > 0 else None
    finding = _fields(rank, step, "control_flow", position, ra or rb)
    finding.detail = (f"the recorded sequences part at record #{position} of step {step}: a has "
                      f"{_describe(ra)}, b has {_describe(rb)}; last common record: "
                      f"{_describe(previous) if previous else '(none: the step starts differently)'}")
    finding.a = None if ra is None else ra.to_json()
    finding.b = None if rb is None else rb.to_json()
    return finding


def _content(rank, step, position, ra: Record, rb: Record) -> Finding:
    ref = parse_record(ra.phase, ra.name)
    if ref is None:
        classification = "untraced"
    elif ref.role == "in":
        classification = "receiver"
    else:
        classification = "origin"
    finding = _fields(rank, step, classification, position, ra)
    finding.a, finding.b = ra.to_json(), rb.to_json()
    if classification == "untraced":
        finding.detail = (f"first difference is the ordinary record {ra.phase}/{ra.name}: no trace records "
                          "before it differ (trace this step at a higher rung to see inputs)")
    elif classification == "receiver":
        finding.detail = (f"input {ref.label} of {ref.event_id} already differed: the difference arose before "
                          "it, in code the trace did not cover")
    else:
        finding.detail = f"all inputs of {ref.event_id} matched; its output {ref.label} differs"
    return finding


def _fields(rank, step, classification, position, record: Record | None) -> Finding:
    finding = Finding(rank, step, classification, position=position)
    if record is None:
        return finding
    finding.record = f"{record.phase}/{record.name}"
    ref = parse_record(record.phase, record.name)
    if ref is None:
        finding.category, finding.phase = "record", record.phase
        return finding
    finding.category, finding.phase, finding.event_id = ref.category, ref.training_phase, ref.event_id
    finding.role, finding.label = ref.role, ref.label
    if ref.category == "op":
        scope, op, _ = split_op_id(ref.event_id)
        finding.module, finding.op = scope, op
    elif ref.category == "probe":
        scope, op, _ = split_op_id(ref.event_id)
        finding.module, finding.op = scope, op
    elif ref.category == "collective":
        _, op, _ = split_op_id(ref.event_id)
        finding.op = op
    elif ref.category == "module":
        if ref.event_id.endswith("@grad"):
            finding.module = ref.event_id[: -len("@grad")].rpartition(".")[0]
        else:
            finding.module = ref.event_id.rpartition(":")[0]
    elif ref.category == "state":
        finding.module = ref.label.rpartition(".")[0]
    return finding


def _annotate(finding: Finding, side_a: _Side, side_b: _Side) -> None:
    if finding.category == "collective" and finding.classification == "origin":
        _check_collective_inputs(finding, side_a, side_b)
    if finding.category in ("op", "probe", "collective") and finding.event_id:
        finding.call_site = (side_a.call_site(finding.rank, finding.step, finding.phase, finding.event_id)
                             or side_b.call_site(finding.rank, finding.step, finding.phase, finding.event_id))
    if finding.category == "op" and finding.op:
        finding.catalog = _catalog_line(finding.op)


def _check_collective_inputs(finding: Finding, side_a: _Side, side_b: _Side) -> None:
    """A collective is an origin only if its inputs matched on every rank."""
    phase = f"trace:collective:{finding.phase}"
    prefix = finding.event_id + "|in:"
    for rank in side_a.run.ranks:
        if rank == finding.rank:
            continue
        records_a, records_b = side_a.records(rank, finding.step), side_b.records(rank, finding.step)
        if records_a is None or records_b is None:
            continue
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
class ReplicaMismatch:
    """Parameters that every rank treats as a replica (their reduced gradients are the same
    bits on every rank) but that hold different values across ranks before the first step."""

    step: int
    ranks: list[int]
    params: list[str]

    def to_json(self) -> dict:
        return asdict(self)


def find_replica_mismatch(run: str | os.PathLike) -> ReplicaMismatch | None:
    """Within one traced run: the parameters whose gradient at the first traced optimizer
    step is bitwise equal on every rank (so it was reduced over them: they are data-parallel
    replicas) while their values before that step differ between ranks.  Parameters that are
    not replicated (tensor- or expert-parallel shards) get different gradients per rank and
    are never reported."""
    side = _Side(run)
    ranks = list(side.run.ranks)
    if len(ranks) < 2:
        return None
    first = None
    params: dict[int, dict[str, Record]] = {}
    grads: dict[int, dict[str, Record]] = {}
    for rank in ranks:
        reader = side.run.stream(rank)
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
