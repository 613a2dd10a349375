"""The comparator's walk over one rank's two streams, step by step (`_Walk`, shared by `diff`,
`divergent_steps` and `_parallel`); `_Bound` lets the ranks' walks stop at the earliest
divergence found on any rank.
"""

from __future__ import annotations

import zlib

from samebits.compare._results import Divergence, RankStep
from samebits.compare._rule import EQUAL, SHAPE_ONLY, record_match
from samebits.stream import Record, StreamReader, step_root as _step_root
from samebits.stream.reader import read_stop_marker

_SHAPE_ONLY_SHOWN = 5  # records compared by shape only, named in the verdict


class _Bound:
    """The earliest step any rank has diverged at so far, shared by the rank walks."""

    def __init__(self):
        self.step: int | None = None

    def lower(self, step: int) -> None:
        if self.step is None or step < self.step:
            self.step = step


class _Walk:
    """The one step walk over a rank's two streams, shared by `diff` and `divergent_steps`.

    Symmetric: swapping the runs swaps ``a`` and ``b`` in what is reported, never the verdict.
    A step one side lacks is a divergence unless that side left it out of its window or its
    stream ended without a clean close (INCOMPLETE).  After a divergence both streams are still
    read and verified, so damage is reported as damage, never as a divergence."""

    def __init__(self, start: int, stop: int | None, verify: bool, bound: _Bound | None = None):
        self.start, self.stop, self.verify = start, stop, verify
        self.counts = {"records": 0, "steps_identical_by_root": 0, "steps_decoded": 0, "records_shape_only": 0}
        self.shared_bound = bound
        self.steps_seen = 0
        self.twin = False  # decided by `_twins`, which no bound affects (`_parallel`)
        self.notes: list[str] = []
        self.incomplete: list[str] = []
        self.shape_only: list[str] = []  # the first records compared by shape only ("rank R step S phase/name")
        self._skipped: dict[str, list] = {}  # side -> [count, first step, last step, its windows]

    @property
    def bound(self) -> int | None:
        """No need to look past the earliest divergence found so far (on any rank)."""
        return None if self.shared_bound is None else self.shared_bound.step

    def rank(self, rank: int, reader_a: StreamReader, reader_b: StreamReader) -> tuple[RankStep, Divergence] | None:
        """Walk one rank in step order: its first divergence, or None (`incomplete` then says why
        if a stream ended early).  Closes both readers."""
        try:
            if not self.verify and self.stop is None and not _declares_cap(reader_a) \
                    and not _declares_cap(reader_b) and reader_b.same_frames_as(reader_a):
                return self._twins(rank, reader_a, reader_b)
            found = self._walk(rank, reader_a, reader_b)
            for reader, label in ((reader_a, "a"), (reader_b, "b")):
                if reader.stop_reason and reader.stop_reason.startswith("truncated"):
                    self.notes.append(f"run {label} rank {rank}: {reader.stop_reason}")
            for label, (count, first, last, windows) in self._skipped.items():
                other = "b" if label == "a" else "a"
                self.incomplete.append(
                    f"run {label} rank {rank} recorded only steps {windows} (its recording window, SAMEBITS_STEPS): "
                    f"{count} step(s) of run {other} outside it were not compared (steps {first} to {last}); "
                    "compare the steps both recorded with --from-step/--to-step")
            if found is not None and self.shared_bound is not None:
                self.shared_bound.lower(found[1].step)
            return found
        finally:
            reader_a.close()
            reader_b.close()

    def _twins(self, rank: int, reader_a: StreamReader, reader_b: StreamReader) -> None:
        """Two closed streams holding the same bytes after their headers (identical runs):
        verify every frame of ``a``; the same checks then hold for ``b``'s, and only its own
        footer offsets remain to check.  Steps of a segment with a size cap are decoded."""
        self.twin = True
        start, counts = self.start, self.counts
        for block in reader_a.steps():
            if block.step >= start:
                self.steps_seen += 1
                capped = [r for r in block.records() if r.capped] if block.may_cap else ()
                counts["records"] += block.num_records - len(capped)
                self._note_shape_only(rank, block.step, capped)
        reader_b.adopt_verified_twin(reader_a)
        counts["steps_identical_by_root"] += self.steps_seen
        return None

    def _note_shape_only(self, rank: int, step: int, records) -> None:
        if records:
            self.counts["records_shape_only"] += len(records)
            for record in records[: max(0, _SHAPE_ONLY_SHOWN - len(self.shape_only))]:
                self.shape_only.append(f"rank {rank} step {step} {record.phase}/{record.name}")

    def _walk(self, rank: int, reader_a: StreamReader, reader_b: StreamReader):
        start, stop, counts = self.start, self.stop, self.counts
        steps_a, steps_b = reader_a.step_frames(defer_checksums=True), reader_b.step_frames(defer_checksums=True)
        past_window = {}  # side iterator -> its first frame at a step >= stop (read, not yet verified)

        def advance(iterator, reader):
            """The next frame inside the window; steps before it are verified and skipped."""
            for frame in iterator:
                block = frame[0]
                if block.step < start:
                    reader.check_root(*frame)
                    continue
                if stop is not None and block.step >= stop:
                    past_window[iterator] = frame
                    return None
                return frame
            return None

        def finish() -> None:
            _finish(((steps_a, reader_a), (steps_b, reader_b)), past_window)

        frame_a, frame_b = advance(steps_a, reader_a), advance(steps_b, reader_b)
        shared, verify, crc32, step_root = self.shared_bound, self.verify, zlib.crc32, _step_root
        while True:
            block_a = frame_a[0] if frame_a else None
            block_b = frame_b[0] if frame_b else None
            if block_a is None or block_b is None or block_a.step != block_b.step:
                skipped = self._missing_step(rank, reader_a, reader_b, block_a, block_b, frame_a, frame_b,
                                             steps_a, steps_b, past_window, finish)
                if not isinstance(skipped, str):
                    return skipped  # a divergence, or None (the end, or INCOMPLETE)
                if skipped == "b":  # b did not record a's step, on purpose: it is not compared
                    frame_a = advance(steps_a, reader_a)
                else:
                    frame_b = advance(steps_b, reader_b)
                continue
            if shared is not None and shared.step is not None and block_a.step > shared.step:
                return None
            self.steps_seen += 1
            payload, records_at, pending = frame_a[1], frame_a[2], frame_a[3]
            decode = verify or block_a.may_cap or block_b.may_cap  # capped records: compared by shape only
            if (payload == frame_b[1] and pending == frame_b[3] and block_a.schema == block_b.schema >= 2
                    and block_a.names_key == block_b.names_key):
                # Byte-equal frames under equal name tables: checking a's checksum and root
                # checks b's (the same bytes), so each is computed once.  (The common case,
                # inlined: this loop runs once per step of the run.)
                if pending is not None and crc32(payload, crc32(pending[0])) != pending[1]:
                    reader_a.check_root(*frame_a)  # raises, naming the frame
                root = step_root(block_a.names_key, memoryview(payload)[records_at:])
                if root != block_a.root:
                    reader_a.check_root(*frame_a[:3], root=root)  # raises, naming the frame
                if not decode:
                    counts["steps_identical_by_root"] += 1
                    counts["records"] += block_a.num_records
                    frame_a, frame_b = advance(steps_a, reader_a), advance(steps_b, reader_b)
                    continue
            else:
                reader_a.check_root(*frame_a)
                reader_b.check_root(*frame_b)
            if (not decode and block_a.root == block_b.root and block_a.num_records == block_b.num_records
                    and block_a.schema == block_b.schema >= 2):
                counts["steps_identical_by_root"] += 1
                counts["records"] += block_a.num_records
            else:
                counts["steps_decoded"] += 1
                records_a, records_b = block_a.records(), block_b.records()
                found, shape_only = _compare_step(rank, block_a.step, records_a, records_b)
                if found is not None:
                    # every record of the divergent step was compared (the count is never 0 for
                    # a divergence found in a step both runs hold)
                    counts["records"] += block_a.num_records - len(shape_only)
                    finish()
                    return RankStep(rank, block_a.step, records_a, records_b, detail=found.detail), found
                self._note_shape_only(rank, block_a.step, shape_only)
                counts["records"] += block_a.num_records - len(shape_only)
            frame_a, frame_b = advance(steps_a, reader_a), advance(steps_b, reader_b)

    def _missing_step(self, rank, reader_a, reader_b, block_a, block_b, frame_a, frame_b, steps_a, steps_b,
                      past_window, finish):
        """The walk's steps differ (or a side ended): the end of the walk (None), a divergence
        (RankStep, Divergence), INCOMPLETE (None, with the reason added), or the side that did
        not record the other's step on purpose ("a" or "b": skip that step)."""
        if block_a is None and block_b is None:  # both ended inside the window
            for reader, label, iterator in ((reader_a, "a", steps_a), (reader_b, "b", steps_b)):
                if not reader.closed_cleanly and iterator not in past_window:
                    self.incomplete.append(
                        f"run {label} rank {rank}: {reader.stop_reason or 'the stream did not close cleanly'}; "
                        "the steps it holds are equal, but the run did not finish, so later steps are unknown")
            return None
        step = min(b.step for b in (block_a, block_b) if b is not None)
        if self.bound is not None and step > self.bound:
            return None
        in_b = block_b is None or (block_a is not None and block_a.step < block_b.step)  # b lacks the step
        missing_in, other = ("b", "a") if in_b else ("a", "b")
        present, present_frame, present_reader, later, missing_iterator, reader = \
            (block_a, frame_a, reader_a, block_b, steps_b, reader_b) if in_b else \
            (block_b, frame_b, reader_b, block_a, steps_a, reader_a)
        ended = later is None and missing_iterator not in past_window
        present_reader.check_root(*present_frame)
        windows = _windows_excluding(reader, step)
        if windows is not None:  # that run did not record this step, on purpose: not compared
            skipped = self._skipped.setdefault(missing_in, [0, step, step, windows])
            skipped[0] += 1
            skipped[2] = step
            return missing_in
        marker = read_stop_marker(reader.path.parent) if ended else None
        if ended and marker is not None:
            self.incomplete.append(_stopped_reason(missing_in, other, rank, step, reader, marker))
            finish()
            return None
        if ended and not reader.closed_cleanly:  # killed, or still writing: the rest is unknown, not different
            self.incomplete.append(
                f"run {missing_in} rank {rank}: its stream ends before step {step}, which run {other} holds, "
                f"without a clean close ({reader.stop_reason or 'no close frame'}): the steps from {step} on "
                "were not compared")
            finish()
            return None
        if ended:
            why = f"its stream ends before it ({reader.stop_reason or 'closed cleanly'})"
        elif self.steps_seen == 0 and later is not None:  # one run's window starts later (a resumed run)
            why = (f"{missing_in.upper()} starts at step {later.step}, {other.upper()} at step {step}: "
                   f"use --from-step {later.step} to compare from there")
        else:
            why = "the step is missing"
        detail = f"run {missing_in} has no step {step} on rank {rank}: {why}"
        records = present.records()
        found = Divergence(step=step, rank=rank, reason=f"ended_{missing_in}" if ended else f"only_in_{other}",
                           records_differing=present.num_records, detail=detail)
        finish()
        records_a, records_b = (records, []) if in_b else ([], records)
        return RankStep(rank, step, records_a, records_b, missing=missing_in, detail=detail), found


def _finish(sides, past_window: dict) -> None:
    """Read and verify the rest of both streams (``sides``: (iterator, reader) each) after a
    divergence or an early end: damage anywhere in them is a `StreamError`, never a verdict."""
    for iterator, reader in sides:
        frame = past_window.pop(iterator, None)
        if frame is not None:
            reader.check_root(*frame)
        for frame in iterator:
            reader.check_root(*frame)


def _compare_step(rank: int, step: int, records_a: list[Record],
                  records_b: list[Record]) -> tuple[Divergence | None, list[Record]]:
    """The first difference in one step (records matched by identity), and the records compared
    by shape only (capped on a side).  Equal records in another order diverge by ``order``."""
    by_key_b = {r.key: r for r in records_b}
    keys_a = set()
    first: Divergence | None = None
    differing = 0
    shape_only: list[Record] = []
    for position, rec_a in enumerate(records_a):
        keys_a.add(rec_a.key)
        rec_b = by_key_b.get(rec_a.key)
        if rec_b is not None:
            match = record_match(rec_a, rec_b)
            if match == SHAPE_ONLY:
                shape_only.append(rec_a)
                continue
            if match == EQUAL:
                continue
        differing += 1
        if first is None:
            first = Divergence(
                step=step, rank=rank, reason="content" if rec_b is not None else "only_in_a",
                phase=rec_a.phase, name=rec_a.name, occurrence=rec_a.occurrence, kind=rec_a.kind,
                a=rec_a.to_dict(), b=None if rec_b is None else rec_b.to_dict(), position=position,
                detail=f"a: {rec_a.summary()}; b: {rec_b.summary() if rec_b else 'no such record'}",
            )
    for position, rec_b in enumerate(records_b):
        if rec_b.key in keys_a:
            continue
        differing += 1
        if first is None:
            first = Divergence(
                step=step, rank=rank, reason="only_in_b", phase=rec_b.phase, name=rec_b.name,
                occurrence=rec_b.occurrence, kind=rec_b.kind, a=None, b=rec_b.to_dict(), position=position,
                detail=f"a: no such record; b: {rec_b.summary()}",
            )
    if first is not None:
        first.records_differing = differing
        return first, shape_only
    return _order_divergence(rank, step, records_a, records_b), shape_only


def _order_divergence(rank: int, step: int, records_a: list[Record], records_b: list[Record]) -> Divergence | None:
    """The same records in another order: a divergence naming the first position where the
    orders part (the live check, hashing records as stored, stops there too)."""
    keys_a, keys_b = [r.key for r in records_a], [r.key for r in records_b]
    if keys_a == keys_b:
        return None
    position = next(i for i, (x, y) in enumerate(zip(keys_a, keys_b)) if x != y)
    rec_a = records_a[position]
    in_b = keys_b.index(rec_a.key)
    rec_b = records_b[in_b]
    moved = sum(1 for x, y in zip(keys_a, keys_b) if x != y)
    label = rec_a.name + (f" #{rec_a.occurrence}" if rec_a.occurrence else "")
    return Divergence(
        step=step, rank=rank, reason="order", phase=rec_a.phase, name=rec_a.name, occurrence=rec_a.occurrence,
        kind=rec_a.kind, a=rec_a.to_dict(), b=rec_b.to_dict(), records_differing=moved, position=position,
        detail=(f"step {step}, rank {rank}, phase {rec_a.phase}: the same records in another order: first out of "
                f"place `{label}` (position {position} in a, {in_b} in b); {moved} of {len(keys_a)} record(s) "
                "are at other positions"),
    )


def _declares_cap(reader: StreamReader) -> bool:
    """Whether the stream's (first) header declares a size cap: it may hold capped records."""
    return reader.header.caps_tensors


def _windows_excluding(reader: StreamReader, step: int) -> str | None:
    """When every segment of ``reader`` read so far recorded a step window (SAMEBITS_STEPS)
    that leaves ``step`` out: those windows as text ("[5, 10)"); else None."""
    shown = []
    for segment in reader.segments:
        window = segment.window
        if not (isinstance(window, list) and len(window) == 2 and isinstance(window[0], int)
                and (window[1] is None or isinstance(window[1], int))):
            return None
        start, stop = window
        if start <= step and (stop is None or step < stop):
            return None
        shown.append(f"[{start}, {'end' if stop is None else stop})")
    return " and ".join(dict.fromkeys(shown)) if shown else None


def _stopped_reason(missing: str, other: str, rank: int, step: int, reader: StreamReader, marker: dict) -> str:
    """What the live check found, for a run it stopped (its ``stopped.json``)."""
    stopped_at = marker.get("stopped_at")
    where = f"at step {stopped_at}" if isinstance(stopped_at, int) else "(at an unrecorded step)"
    by = marker.get("rank")
    reference = marker.get("reference")
    found = str(marker.get("reason") or "diverged from reference")
    return (f"run {missing} was stopped by its live check {where}"
            + (f" on rank {by}" if isinstance(by, int) else "")
            + f" ({found}" + (f": its step root differed from {reference}'s" if reference else "") + "); "
            f"here its records up to there equal run {other}'s on rank {rank} (the live check compares step roots, "
            "which also differ when the names were interned in another order or the reference is another run), "
            f"and it recorded nothing after it, so steps from {step} on were not compared")
