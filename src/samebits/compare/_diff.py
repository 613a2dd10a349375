"""`diff(a, b)`: check the runs can be compared, walk their ranks (`_walk`, `_parallel`) and
turn what the walks found into a verdict; `divergent_steps` yields each rank's first divergent
step from the same walk.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Iterator

from samebits.compare import _parallel
from samebits.compare._commands import output_paths_only
from samebits.compare._global import GlobalDiffResult, diff_global
from samebits.compare._results import DiffResult, Divergence, RankStep, ResumedWindow, resumed_note, resumed_unjudged
from samebits.compare._walk import _SHAPE_ONLY_SHOWN, _Bound, _Walk, _windows_excluding
from samebits.errors import ConfigError, IncomparableRunsError, StreamError
from samebits.stream import Run, StreamReader, open_run
from samebits.stream.gaps import read_gaps, summarise_gaps
from samebits.stream.reader import require_same_digest_version
from samebits.verdicts import Verdict


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

    ``start_step``/``stop_step`` restrict the comparison to ``start <= step < stop``.  A run
    whose streams start at a later step K (a resumed run) is compared from K on: no divergence
    there is INCOMPLETE, since the steps before K are in one run only.  ``verify`` decodes and
    compares every step instead of deciding equal steps by their roots.  Raises `ConfigError`
    for an empty window, `IncomparableRunsError` when the runs cannot be compared,
    `StreamError` when a stream is unreadable or damaged.

    ``by="global"``: compare runs of any layouts by their global records (a `GlobalDiffResult`;
    the other options do not apply).  ``jobs`` walks ranks in that many processes (None: one
    per core for large runs, docs/scale.md); ``distributed`` splits them among a torchrun
    job's processes.  The result is the same object either way.
    """
    start, stop = _window(start_step, stop_step)
    if by != "local":
        if by != "global":
            raise ConfigError(f"by = {by!r}: compare runs by \"local\" records (rank by rank, the default) "
                              "or by \"global\" tensor (runs of different layouts; --by global).")
        return diff_global(a, b, start=start, stop=stop)
    run_a, run_b = open_run(a), open_run(b)
    require_same_digest_version(run_a, run_b)  # before anything is compared: never a verdict across versions
    notes: list[str] = []
    incomplete = _missing_ranks(run_a, run_b)
    ranks = [r for r in run_a.ranks if r in run_b.files]
    resumed = _resumed_start(run_a, run_b, ranks[0]) if ranks else None
    if resumed is not None and start_step is None:
        start = resumed[1]
        notes.append(resumed[2])
    _check_comparable(run_a, run_b, allow_config_diff, ignore_config_keys, notes, resumed=resumed is not None)
    if not allow_config_diff and ranks:
        _check_names(ranks[0], run_a.files[ranks[0]], run_b.files[ranks[0]], start, stop)
    walked = _walk_ranks(run_a, run_b, ranks, start, stop, verify, jobs, distributed)
    notes += walked.notes + _environment_notes(run_a, run_b)
    incomplete += walked.incomplete
    if walked.counts["records_shape_only"]:
        incomplete.append(_shape_only_reason(run_a, run_b, walked.counts["records_shape_only"], walked.shape_only))
    unresumed = resumed if start_step is None else None  # a resume the window did not choose
    verdict, first, first_ranks = _verdict(walked, unresumed, start, stop, notes, incomplete)
    if walked.divergences and incomplete:
        notes.extend(incomplete)  # the divergence is proof; what could not be read is still said
        incomplete = []
    verdict = _with_gaps(verdict, first, a, b, notes, incomplete)
    return DiffResult(a=str(a), b=str(b), verdict=verdict, first_divergence=first, ranks_diverged_first=first_ranks,
                      divergences=walked.divergences, compared=walked.counts, notes=notes, incomplete=incomplete,
                      resumed=None if unresumed is None else ResumedWindow(unresumed[0], unresumed[1]))


@dataclass
class _Walked:
    """Every rank's walk, merged in rank order."""

    counts: dict
    divergences: dict[int, Divergence] = field(default_factory=dict)  # per rank, its first divergence
    steps_compared: int = 0
    notes: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    shape_only: list[str] = field(default_factory=list)  # the first records compared by shape only


def _walk_ranks(run_a: Run, run_b: Run, ranks: list[int], start: int, stop: int | None, verify: bool,
                jobs: int | None, distributed: bool) -> _Walked:
    """Walk the ranks both runs hold, serially or in processes (`_parallel`: the same result).
    Once a rank diverges at step S, later ranks stop looking past S."""
    walked = _Walked({"ranks": len(ranks), "steps": 0, "records": 0, "steps_identical_by_root": 0,
                      "steps_decoded": 0, "records_shape_only": 0})
    bound = _Bound()
    num_jobs = 1 if distributed else _parallel.num_jobs(jobs, run_a, run_b, ranks)
    walks = None
    if distributed:
        walks = _parallel.distributed_walks(run_a, run_b, ranks, start, stop, verify)
    elif num_jobs > 1:
        walks = _parallel.walk_ranks(run_a, run_b, ranks, start, stop, verify, num_jobs)
    for rank in ranks:
        if walks is None:
            walk = _Walk(start, stop, verify, bound)
            found = walk.rank(rank, run_a.stream(rank), run_b.stream(rank))
        else:
            parallel = next(walks)
            walk, found = parallel.walk, None if parallel.divergence is None else (None, parallel.divergence)
        walked.steps_compared += walk.steps_seen
        walked.counts["steps"] = max(walked.counts["steps"], walk.steps_seen)
        for key, value in walk.counts.items():
            walked.counts[key] += value
        walked.notes.extend(walk.notes)
        walked.incomplete.extend(walk.incomplete)
        walked.shape_only.extend(walk.shape_only[: _SHAPE_ONLY_SHOWN - len(walked.shape_only)])
        if found is not None:
            walked.divergences[rank] = found[1]
    return walked


def _verdict(walked: _Walked, resumed, start: int, stop: int | None, notes: list[str],
             incomplete: list[str]) -> tuple[Verdict, Divergence | None, list[int]]:
    """(verdict, the first divergence, the ranks that diverge first) from the walks; a reason
    the runs could not be called identical is added to ``incomplete``.  ``resumed``: one run
    resumed the other and the window was not chosen (the steps before it are in one run only)."""
    divergences = walked.divergences
    if divergences:
        step = min(d.step for d in divergences.values())
        at_step = [d for d in divergences.values() if d.step == step]
        first = min(at_step, key=lambda d: (d.position, d.rank))
        if first.reason == "order":  # equal values: the table alone would show two equal sides
            notes.insert(0, first.detail)
        return Verdict.DIVERGED, first, sorted(d.rank for d in at_step)
    if incomplete:
        return Verdict.INCOMPLETE, None, []
    if walked.steps_compared == 0:
        window = f"[{start}, {stop if stop is not None else 'end'})"
        incomplete.append(f"nothing to compare: neither run holds a step in the window {window}")
    elif walked.counts["records"] == 0:  # steps, but empty ones: equal roots of nothing prove nothing
        incomplete.append(f"nothing to compare: the {walked.steps_compared} step(s) in the window hold no records "
                          "(was everything left out by the recording choices? see samebits show RUN)")
    elif resumed is not None:  # the steps before K are in one run only: said, never called identical
        incomplete.append(resumed_unjudged(resumed[0], resumed[1]))
    else:
        return Verdict.IDENTICAL, None, []
    return Verdict.INCOMPLETE, None, []


def _with_gaps(verdict: Verdict, first, a, b, notes: list[str], incomplete: list[str]) -> Verdict:
    """The verdict with the gaps of either run (`samebits.stream.gaps`): INCOMPLETE unless the
    divergence comes before the first gap that touches the verdict; other gaps are a note."""
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
    """Yield, in rank order, each rank's first divergent step as a `RankStep` (both sides'
    decoded records); ranks without one are skipped.  ``a``/``b``: run directories or `Run`s.
    Streams are verified as in `diff`; a stream cut short or a missing rank is not reported."""
    start, stop = _window(start_step, stop_step)
    run_a = a if isinstance(a, Run) else open_run(a)
    run_b = b if isinstance(b, Run) else open_run(b)
    require_same_digest_version(run_a, run_b)
    for rank in [r for r in run_a.ranks if r in run_b.files]:
        found = _Walk(start, stop, False).rank(rank, run_a.stream(rank), run_b.stream(rank))
        if found is not None:
            yield found[0]


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
        unrecorded = (r for r in range(world) if r not in recorded)  # stops at the 8th, never walks the world
        neither = list(itertools.islice(unrecorded, max(0, min(8, num_neither))))
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
    """(label, K, the note) when one run's streams start at a later step K, not because of a
    recording window: it resumed the other's checkpoint of step K.  Else None."""
    (first_a, reader_a), (first_b, reader_b) = _first_step(run_a, rank), _first_step(run_b, rank)
    if first_a is None or first_b is None or first_a == first_b:
        return None
    label, first, other, reader = ("b", first_b, first_a, reader_b) if first_b > first_a else \
        ("a", first_a, first_b, reader_a)
    if _windows_excluding(reader, other) is not None:
        return None  # a recording window, not a resume: the walk reports the steps left out
    return label, first, resumed_note(label, first, other)


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


def _shape_only_reason(run_a: Run, run_b: Run, count: int, examples: list[str]) -> str:
    caps = [run.header.max_tensor_bytes for run in (run_a, run_b)]
    cap = f"{caps[0]}" if caps[0] == caps[1] else f"a: {caps[0]}, b: {caps[1]}"
    return (f"{count} record(s) were compared by shape and dtype only, never by value: they were larger than the "
            f"size cap when recorded (max_tensor_bytes {cap}), so they hold no digest (e.g. {', '.join(examples)}). "
            "To compare their values, record both runs without the cap (leave out --max-tensor-bytes, unset "
            "SAMEBITS_MAX_TENSOR_BYTES) or with a cap above the largest tensor")
