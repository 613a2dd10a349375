"""The comparator: are two runs bitwise identical, and if not, where did they first part?

`diff(a, b)` streams both runs rank by rank.  Nothing stored is trusted: every frame's
checksum is checked and every step root is recomputed from the step's records by the
reader (a damaged stream is a `StreamError`, never a verdict).  Steps whose recomputed
roots (and record counts) agree are equal without decoding; the first step that differs
on a rank is decoded and its records are matched by identity (kind, phase, name,
occurrence), never by position.  `divergent_steps` is that same walk, yielding each rank's
first divergent step.  The result is a `DiffResult`, the same object `samebits diff
--json` prints; its verdict is IDENTICAL only when every selected step of every rank of the
world was compared in two complete streams.
"""

from __future__ import annotations

import os
import re
import shlex
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from samebits.compare import _parallel
from samebits.errors import ConfigError, IncomparableRunsError, StreamError
from samebits.stream import step_root as _step_root
from samebits.stream.gaps import read_gaps, summarise_gaps
from samebits.stream.reader import (Record, Run, StreamReader, open_run, read_stop_marker,
                                    require_same_digest_version)
from samebits.verdicts import ToDict, Verdict, serialised
from samebits.compare._global import GlobalDiffResult, GlobalTensorResult, diff_global
from samebits.compare._rule import DIFFERS, EQUAL, SHAPE_ONLY, record_match

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
    """One rank's first divergent step: the decoded records of both runs there.  A side
    whose stream has no such step (ended, or skipped it) has an empty list and is named in
    ``missing``."""

    rank: int
    step: int
    records_a: list[Record]
    records_b: list[Record]
    missing: str | None = None  # "a" or "b": that run has no such step
    detail: str = ""


@dataclass
class DiffResult(ToDict):
    """What `diff` found.  ``verdict`` is a `Verdict`: IDENTICAL, DIVERGED or INCOMPLETE
    (could not decide: a stream missing or cut short, or a window holding no step)."""

    dict_keys = ("verdict", "exit_code", "a", "b", "first_divergence", "divergences_by_rank", "compared",
                 "incomplete", "notes")

    a: str
    b: str
    verdict: Verdict
    first_divergence: Divergence | None  # written with the ranks that diverge first (`dict_extras`)
    ranks_diverged_first: list[int]
    divergences: dict[int, Divergence] = field(  # per rank, its first divergence (if any)
        metadata=serialised(key="divergences_by_rank", convert=lambda by_rank: {
            str(rank): divergence.to_dict() for rank, divergence in sorted(by_rank.items())}))
    compared: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # why the verdict could not be IDENTICAL

    @property
    def identical(self) -> bool:
        return self.verdict is Verdict.IDENTICAL

    def dict_extras(self) -> dict:
        first = None
        if self.first_divergence is not None:
            first = {**self.first_divergence.to_dict(), "ranks": self.ranks_diverged_first}
        return {"exit_code": self.verdict.exit_code, "first_divergence": first}


def diff(
    a: str | os.PathLike,
    b: str | os.PathLike,
    *,
    start_step: int | None = None,
    stop_step: int | None = None,
    allow_config_diff: bool = False,
    verify: bool = False,
    ignore_config_keys: tuple[str, ...] = (),
    by: str = "local",
    jobs: int | None = None,
    distributed: bool = False,
) -> DiffResult | GlobalDiffResult:
    """Compare run directories ``a`` and ``b`` bit for bit.

    ``start_step``/``stop_step`` restrict the comparison to ``start <= step < stop``
    (e.g. a resumed run from its resume step on).  A run whose streams start at a later step K
    than the other's (a resumed run, not a recording window) may have been started by another
    command line.  Without ``start_step`` it is compared from step K on: a divergence there is
    DIVERGED; no divergence is INCOMPLETE, with the reason, since the steps before K are in one
    run only (``start_step=K`` compares exactly those steps both hold).  ``verify`` decodes and compares every
    step's records instead of deciding equal steps by their (recomputed) roots.  Raises
    `ConfigError` for an empty window, `IncomparableRunsError` when the runs cannot be
    compared (digest version, world size, config, recorded names), `StreamError` when a stream is
    unreadable or damaged (naming file, byte offset and frame).

    ``by="global"`` compares runs of any layouts and world sizes by their global records
    (`Recorder.global_tensors`: digests of full tensors, matched by phase and name) and
    returns a `GlobalDiffResult` (compare/_global.py); the other options do not apply.

    ``jobs`` walks ranks in that many processes (1: serial; None: one per core when the
    runs are large, see docs/scale.md); ``distributed`` splits the ranks among the
    processes of a torchrun job instead (every process returns the result).  The result is
    the same object either way.
    """
    start, stop = _window(start_step, stop_step)
    if by != "local":
        if by != "global":
            raise ConfigError(f"by = {by!r}: compare runs by \"local\" records (rank by rank, the default) "
                              "or by \"global\" tensor (runs of different layouts; --by global).")
        return diff_global(a, b, start=start, stop=stop)
    run_a, run_b = open_run(a), open_run(b)
    require_same_digest_version(run_a, run_b)  # before anything is compared: never a verdict across versions
    try:
        notes: list[str] = []
        incomplete = _missing_ranks(run_a, run_b)
        ranks = [r for r in run_a.ranks if r in run_b.files]
        resumed = _resumed_start(run_a, run_b, ranks[0]) if ranks else None
        if resumed is not None and start_step is None:
            start = resumed[1]
            notes.append(resumed[2])
        _check_comparable(run_a, run_b, allow_config_diff, ignore_config_keys, notes, resumed=resumed is not None)
        counts = {"ranks": len(ranks), "steps": 0, "records": 0, "steps_identical_by_root": 0, "steps_decoded": 0,
                  "records_shape_only": 0}
        shape_only: list[str] = []  # the first records compared by shape only (over the size cap)
        if not allow_config_diff and ranks:
            _check_names(ranks[0], run_a.files[ranks[0]], run_b.files[ranks[0]], start, stop)
        # One rank at a time, or chunks of ranks in processes (threads were measured slower:
        # the per-frame work holds the GIL too often), merged into the serial result (see
        # _parallel).  Once a rank diverges at step S, later ranks stop looking past S.
        bound = _Bound()
        divergences: dict[int, Divergence] = {}
        steps_compared = 0
        num_jobs = 1 if distributed else _parallel.num_jobs(jobs, run_a, run_b, ranks)
        walks = None
        if distributed:
            walks = _parallel.distributed_walks(run_a, run_b, ranks, start, stop, verify, _Walk, _Bound)
        elif num_jobs > 1:
            walks = _parallel.walk_ranks(run_a, run_b, ranks, start, stop, verify, num_jobs, _Walk, _Bound)
        for rank in ranks:
            if walks is None:
                walk = _Walk(start, stop, verify, bound)
                found = walk.rank(rank, run_a.stream(rank), run_b.stream(rank))
            else:
                walked = next(walks)
                walk, found = walked.walk, None if walked.divergence is None else (None, walked.divergence)
            steps_compared += walk.steps_seen
            counts["steps"] = max(counts["steps"], walk.steps_seen)
            for key, value in walk.counts.items():
                counts[key] += value
            notes.extend(walk.notes)
            incomplete.extend(walk.incomplete)
            shape_only.extend(walk.shape_only[: _SHAPE_ONLY_SHOWN - len(shape_only)])
            if found is not None:
                divergences[rank] = found[1]
        notes.extend(_environment_notes(run_a, run_b))
        if counts["records_shape_only"]:
            incomplete.append(_shape_only_reason(run_a, run_b, counts["records_shape_only"], shape_only))
    finally:
        run_a.close()
        run_b.close()
    first, first_ranks = None, []
    if divergences:
        step = min(d.step for d in divergences.values())
        at_step = [d for d in divergences.values() if d.step == step]
        first = min(at_step, key=lambda d: (d.position, d.rank))
        first_ranks = sorted(d.rank for d in at_step)
        verdict = Verdict.DIVERGED
        if first.reason == "order":  # equal values: the table alone would show two equal sides
            notes.insert(0, first.detail)
    elif incomplete:
        verdict = Verdict.INCOMPLETE
    elif steps_compared == 0:
        verdict = Verdict.INCOMPLETE
        window = f"[{start}, {stop if stop is not None else 'end'})"
        incomplete.append(f"nothing to compare: neither run holds a step in the window {window}")
    elif counts["records"] == 0:  # steps, but empty ones: equal roots of nothing prove nothing
        verdict = Verdict.INCOMPLETE
        incomplete.append(f"nothing to compare: the {steps_compared} step(s) in the window hold no records (was "
                          "everything left out by the recording choices? see samebits show RUN)")
    elif resumed is not None and start_step is None:
        verdict = Verdict.INCOMPLETE  # the steps before K are in one run only: said, never called identical
        label, resumed_at, _ = resumed
        incomplete.append(f"no divergence from step {resumed_at} on, where {label} starts ({label} resumed a run?); "
                          f"the earlier steps are in the other run only. To judge the resume, compare the steps both "
                          f"hold: --from-step {resumed_at}")
    else:
        verdict = Verdict.IDENTICAL
    if divergences and incomplete:
        notes.extend(incomplete)  # the divergence is proof; what could not be read is still said
        incomplete = []
    verdict = _with_gaps(verdict, first, a, b, notes, incomplete)
    return DiffResult(
        a=str(a),
        b=str(b),
        verdict=verdict,
        first_divergence=first,
        ranks_diverged_first=first_ranks,
        divergences=divergences,
        compared=counts,
        notes=notes,
        incomplete=incomplete,
    )


def _with_gaps(verdict: Verdict, first, a, b, notes: list[str], incomplete: list[str]) -> Verdict:
    """The verdict with what samebits could not record in either run (`samebits.stream.gaps`):
    identical records are no proof where some are missing, and a divergence at or after the
    first gapped step may be the gap's own making (INCOMPLETE); one before it stands.  Gaps in
    the census or the tracking of state only are a note: the streams compared are whole."""
    gaps = [gap for run in (a, b) for gap in read_gaps(run)]
    if not gaps:
        return verdict
    line = summarise_gaps(gaps)
    steps = [gap.get("step") if isinstance(gap.get("step"), int) else -1 for gap in gaps if gap.get("verdict", True)]
    if not steps or verdict is Verdict.INCOMPLETE or (
            verdict is Verdict.DIVERGED and first is not None and first.step < min(steps)):
        notes.append(line)
        return verdict
    incomplete.insert(0, line + ("; nothing from the run on is proof" if min(steps) < 0 else
                                 f"; nothing from step {min(steps)} on is proof"))
    return Verdict.INCOMPLETE


def divergent_steps(a, b, *, start_step: int | None = None, stop_step: int | None = None) -> Iterator[RankStep]:
    """Yield, for each rank both runs recorded (in rank order), its first divergent step as
    a `RankStep` (both sides' decoded records).  Ranks with no divergence in the window are
    not yielded.  ``a``/``b`` are run directories or open `Run` objects.  Streams are
    verified as in `diff` (a damaged one raises `StreamError`); unlike `diff`, a stream
    cut short or a missing rank is not reported here (use `diff` for the verdict)."""
    start, stop = _window(start_step, stop_step)
    run_a = a if isinstance(a, Run) else open_run(a)
    run_b = b if isinstance(b, Run) else open_run(b)
    require_same_digest_version(run_a, run_b)
    try:
        for rank in [r for r in run_a.ranks if r in run_b.files]:
            found = _Walk(start, stop, False).rank(rank, run_a.stream(rank), run_b.stream(rank))
            if found is not None:
                yield found[0]
    finally:
        if run_a is not a:
            run_a.close()
        if run_b is not b:
            run_b.close()


def _window(start_step, stop_step) -> tuple[int, int | None]:
    for name, value in (("--from-step", start_step), ("--to-step", stop_step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"{name} {value!r}: steps are non-negative integers.")
    start = start_step or 0
    if stop_step is not None and stop_step <= start:
        raise ConfigError(f"nothing to compare: the window [{start}, {stop_step}) holds no step "
                          "(--from-step must be below --to-step).")
    return start, stop_step


def _missing_ranks(run_a: Run, run_b: Run) -> list[str]:
    """A rank of the world recorded by one run only, or by neither although selected for
    recording, is missing data: the runs cannot be called identical.  (Never loops over
    the whole world: a header may claim any world size.)"""
    reasons = []
    for label, run, other in (("a", run_a, run_b), ("b", run_b, run_a)):
        only_other = sorted(set(other.files) - set(run.files))
        if only_other:
            shown = ", ".join(map(str, only_other[:8])) + (" ..." if len(only_other) > 8 else "")
            reasons.append(f"run {label} ({run.path}) has no stream for rank{'s' if len(only_other) > 1 else ''} "
                           f"{shown} of world size "
                           f"{run.world_size} that the other run recorded: that data is missing")
    world = max(run_a.world_size, run_b.world_size)
    recorded = set(run_a.files) | set(run_b.files)
    selections = [run.header.ranks for run in (run_a, run_b)]
    if all(isinstance(selected, list) for selected in selections):  # both recorded a rank selection
        expected = {r for selected in selections for r in selected if isinstance(r, int) and 0 <= r < world}
        neither = sorted(expected - recorded)
        num_neither = len(neither)
    else:
        num_neither = world - len(recorded)
        neither = []
        rank = 0
        while len(neither) < 8 and rank < world and len(neither) < num_neither:
            if rank not in recorded:
                neither.append(rank)
            rank += 1
    if num_neither > 0:
        shown = ", ".join(map(str, neither[:8])) + (" ..." if num_neither > 8 else "")
        reasons.append(f"neither run has a stream for {num_neither} rank(s) of world size {world} ({shown}): "
                       "that data is missing (record every rank, or select ranks with SAMEBITS_RANKS)")
    return reasons


def _first_step(run: Run, rank: int) -> tuple[int | None, StreamReader | None]:
    """The first step ``rank``'s stream holds, and the reader that read it (closed); None when
    it holds none or cannot be read (the walk says why)."""
    reader = run.stream(rank)
    try:
        block = next(iter(reader.steps()), None)
    except StreamError:
        return None, None
    finally:
        reader.close()
    return (None, None) if block is None else (block.step, reader)


def _resumed_start(run_a: Run, run_b: Run, rank: int) -> tuple[str, int, str] | None:
    """When one run's streams start at a later step K than the other's, and not because a
    recording window (SAMEBITS_STEPS) left the earlier steps out: that run resumed the other's
    checkpoint of step K, so the comparison starts at K.  Returns (label, K, the note)."""
    (first_a, reader_a), (first_b, reader_b) = _first_step(run_a, rank), _first_step(run_b, rank)
    if first_a is None or first_b is None or first_a == first_b:
        return None
    label, first, other, reader = ("b", first_b, first_a, reader_b) if first_b > first_a else \
        ("a", first_a, first_b, reader_a)
    if _windows_excluding(reader, other) is not None:
        return None  # a recording window, not a resume: the walk reports the steps left out
    return label, first, (f"{label} starts at step {first} and {'a' if label == 'b' else 'b'} at step {other} "
                          f"({label} resumed a run?): compared from step {first} on")


# Options whose value may be where a run writes (`--out`, `--ckpt-dir`, `--output-dir`,
# `--save-path`, `--log-dir`); a name alone proves nothing (`--log debug`, `--output softmax`,
# `--model-checkpoint bert-base`), so the value must also be a path the run wrote: on disk, inside
# the run's own folder.  Options that name what a run reads are never outputs.
_OUTPUT_OPTION = re.compile(r"^--?(?:[\w-]*[-_])?(?:out|output|outdir|ckpt|checkpoint|checkpoints|save|logdir|log|logs)"
                            r"(?:[-_](?:dir|path|folder|root|prefix|file|to))?$")
_INPUT_WORD = re.compile(r"resume|load|init|from|restore|pretrained|model|input|source|src|read", re.IGNORECASE)


def output_paths_only(command_a: str, command_b: str, run_a: str | os.PathLike | None = None,
                      run_b: str | os.PathLike | None = None) -> list[tuple[str, str, str]] | None:
    """The (option, a's value, b's value) where two recorded command lines differ, when they
    differ only in where the runs wrote: the option is an output option by name (`--out`,
    `--ckpt-dir`, ...; never one that reads, such as `--resume-from-checkpoint`,
    `--load-checkpoint`, `--init-checkpoint`) and each value is a path that exists on disk
    inside its own run's folder (``run_a``, ``run_b``: the folders holding the streams; a
    relative value is taken from the current directory).  None when any other word differs, or
    when a value is not such a path (`--log debug` vs `warning`: a setting)."""
    try:
        words_a, words_b = shlex.split(command_a), shlex.split(command_b)
    except ValueError:
        return None
    if len(words_a) != len(words_b):
        return None
    found = []
    for i, (word_a, word_b) in enumerate(zip(words_a, words_b)):
        if word_a == word_b:
            continue
        option_a, _, value_a = word_a.partition("=")
        option_b, _, value_b = word_b.partition("=")
        if "=" in word_a and "=" in word_b and option_a == option_b and option_a.startswith("-"):
            option = option_a  # --out=runs/a
        elif i > 0 and words_a[i - 1] == words_b[i - 1]:
            option, value_a, value_b = words_a[i - 1], word_a, word_b  # --out runs/a
        else:
            return None
        if not _OUTPUT_OPTION.match(option) or _INPUT_WORD.search(option) or _is_number(value_a) \
                or _is_number(value_b):
            return None  # an input or a setting (--save-at 4 vs 5 is a step, not a folder)
        if not (_written_by(value_a, run_a) and _written_by(value_b, run_b)):
            return None  # not a path this run wrote: a config difference (--log debug / warning)
        found.append((option, value_a, value_b))
    return found


def _written_by(value: str, run: str | os.PathLike | None) -> bool:
    """Whether ``value`` names a path on disk inside the run folder ``run`` (or the folder itself)."""
    if run is None or not value:
        return False
    try:
        path = os.path.realpath(os.path.expanduser(value))
        folder = os.path.realpath(run)
        return os.path.exists(path) and os.path.commonpath([path, folder]) == folder
    except (OSError, ValueError):
        return False


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_comparable(run_a: Run, run_b: Run, allow: bool, ignore_keys, notes: list[str], *,
                      resumed: bool = False) -> None:
    """Refuse runs that cannot be compared; a recorded command line that differs only in output
    paths, or because one run resumed the other (``resumed``), is noted, not refused."""
    problems = []
    if run_a.world_size != run_b.world_size:
        raise IncomparableRunsError(
            f"cannot compare {run_a.path} (world size {run_a.world_size}) with {run_b.path} "
            f"(world size {run_b.world_size}): a different world size changes reduction orders, "
            "so the bits are expected to differ. Compare runs of the same world size, or compare "
            "full tensors with --by global if both runs recorded global digests "
            "(Recorder.global_tensors).",
            [f"world size: {run_a.world_size} vs {run_b.world_size}"],
        )
    only_a = sorted(set(run_a.ranks) - set(run_b.ranks))
    only_b = sorted(set(run_b.ranks) - set(run_a.ranks))
    if only_a or only_b:
        line = f"recorded ranks differ: only in a {only_a}, only in b {only_b}"
        if not set(run_a.ranks) & set(run_b.ranks):
            raise IncomparableRunsError(f"cannot compare: {line}; the runs share no rank.", [line])
        notes.append(line + " (compared the ranks both have)")
    config_a, config_b = run_a.header.config, run_b.header.config
    for key in sorted(set(config_a) | set(config_b)):
        if key in ignore_keys:
            continue
        if key not in config_b:
            problems.append(f"config key {key!r} only in a (= {config_a[key]!r})")
        elif key not in config_a:
            problems.append(f"config key {key!r} only in b (= {config_b[key]!r})")
        elif config_a[key] != config_b[key]:
            if key == "command" and isinstance(config_a[key], str) and isinstance(config_b[key], str):
                outputs = output_paths_only(config_a[key], config_b[key], run_a.path, run_b.path)
                if outputs or resumed:
                    why = ("only in where they write: " + ", ".join(f"{o} {va} / {vb}" for o, va, vb in outputs)
                           if outputs else "as a resumed run's does")
                    notes.append(f"the recorded command lines differ {why} (a: {config_a[key]}; b: {config_b[key]})")
                    continue
            problems.append(f"config {key!r}: a = {config_a[key]!r}, b = {config_b[key]!r}")
    if problems:
        if not allow:
            raise IncomparableRunsError(
                f"cannot compare {run_a.path} with {run_b.path}: their configs differ:\n  - "
                + "\n  - ".join(problems)
                + "\nIf the difference is intended (a code or setting change under test), pass "
                "--allow-config-diff.",
                problems,
            )
        notes.extend(f"allowed: {p}" for p in problems)


def _environment_notes(run_a: Run, run_b: Run) -> list[str]:
    env_a, env_b = run_a.header.environment, run_b.header.environment
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


class _Bound:
    """The earliest step any rank has diverged at so far, shared by the rank walks."""

    def __init__(self):
        self.step: int | None = None

    def lower(self, step: int) -> None:
        if self.step is None or step < self.step:
            self.step = step


class _Walk:
    """The one step walk over a rank's two streams, shared by `diff` and `divergent_steps`.

    Symmetric by construction: every decision looks at both sides alike, so swapping the runs
    swaps ``a`` and ``b`` in what is reported and never changes the verdict.  A step one side
    holds and the other does not is a divergence unless the other side did not record it on
    purpose (outside its recording window: not compared, INCOMPLETE) or its stream ended
    without a clean close (a killed or still running writer: INCOMPLETE).  Once a divergence
    is found, the rest of both streams is still read and verified, so that damage (a dropped
    frame, steps out of order) is reported as damage, never as a divergence."""

    def __init__(self, start: int, stop: int | None, verify: bool, bound: _Bound | None = None):
        self.start, self.stop, self.verify = start, stop, verify
        self.counts = {"records": 0, "steps_identical_by_root": 0, "steps_decoded": 0, "records_shape_only": 0}
        self.shared_bound = bound
        self.steps_seen = 0
        self.notes: list[str] = []
        self.incomplete: list[str] = []
        self.shape_only: list[str] = []  # the first records compared by shape only ("rank R step S phase/name")
        self._skipped: dict[str, list] = {}  # side -> [count, first step, last step, its windows]

    @property
    def bound(self) -> int | None:
        """No need to look past the earliest divergence found so far (on any rank)."""
        return None if self.shared_bound is None else self.shared_bound.step

    def rank(self, rank: int, reader_a: StreamReader, reader_b: StreamReader) -> tuple[RankStep, Divergence] | None:
        """Walk one rank in step order: its first divergence, or None (then `incomplete`
        says whether a stream ended without a clean close inside the window).  Closes both
        readers."""
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
        """Two closed streams holding the same bytes after their headers (the common case
        of identical runs): verify every frame of ``a`` (checksums, recomputed roots,
        structure, footer); ``b``'s frames are the same bytes, so the same checks hold for
        them, and only ``b``'s own footer offsets remain to check.  No divergence.  (Steps of
        a later segment that declares a size cap are decoded: their capped records are
        compared by shape only.)"""
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
            """Read and verify the rest of both streams (after a divergence or an early end):
            damage anywhere in them is a `StreamError`, never a verdict."""
            for iterator, reader in ((steps_a, reader_a), (steps_b, reader_b)):
                frame = past_window.pop(iterator, None)
                if frame is not None:
                    reader.check_root(*frame)
                for frame in iterator:
                    reader.check_root(*frame)

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
        missing_in = "b" if (block_b is None or (block_a is not None and block_a.step < block_b.step)) else "a"
        other = "a" if missing_in == "b" else "b"
        present = block_a if missing_in == "b" else block_b
        present_frame = frame_a if missing_in == "b" else frame_b
        missing_iterator = steps_b if missing_in == "b" else steps_a
        reader = reader_b if missing_in == "b" else reader_a
        later = block_b if missing_in == "b" else block_a
        ended = later is None and missing_iterator not in past_window
        (reader_a if missing_in == "b" else reader_b).check_root(*present_frame)
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
        records_a, records_b = (records, []) if missing_in == "b" else ([], records)
        return RankStep(rank, step, records_a, records_b, missing=missing_in, detail=detail), found


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


def _compare_step(rank: int, step: int, records_a: list[Record],
                  records_b: list[Record]) -> tuple[Divergence | None, list[Record]]:
    """The first difference in one step (records matched by identity), and the records
    compared by shape only (over the size cap on either side: equal dtype and shape, no
    digest to compare).  Equal records in another order are a divergence of reason
    ``order`` naming the first record out of place."""
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
    """The same records (by identity and value) in another order: a divergence naming the
    first position where the two orders part (the live check, which hashes the records as
    stored, stops at such a step too)."""
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


_SHAPE_ONLY_SHOWN = 5  # records compared by shape only, named in the verdict


def _declares_cap(reader: StreamReader) -> bool:
    """Whether the stream's (first) header declares a size cap: it may hold capped records."""
    return reader.header.caps_tensors


def _windows_excluding(reader: StreamReader, step: int) -> str | None:
    """When every segment of ``reader`` read so far recorded a step window (SAMEBITS_STEPS)
    that leaves ``step`` out: those windows as text ("[5, 10)"); else None."""
    shown = []
    for segment in reader.segments:
        window = segment.get("window")
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


def _shape_only_reason(run_a: Run, run_b: Run, count: int, examples: list[str]) -> str:
    caps = [run.header.max_tensor_bytes for run in (run_a, run_b)]
    cap = f"{caps[0]}" if caps[0] == caps[1] else f"a: {caps[0]}, b: {caps[1]}"
    return (f"{count} record(s) were compared by shape and dtype only, never by value: they were larger than the "
            f"size cap when recorded (max_tensor_bytes {cap}), so they hold no digest (e.g. {', '.join(examples)}). "
            "To compare their values, record both runs without the cap (leave out --max-tensor-bytes, unset "
            "SAMEBITS_MAX_TENSOR_BYTES) or with a cap above the largest tensor")


__all__ = ["diff", "divergent_steps", "record_match", "EQUAL", "DIFFERS", "SHAPE_ONLY",
           "DiffResult", "Divergence", "RankStep", "GlobalDiffResult",
           "GlobalTensorResult"]
