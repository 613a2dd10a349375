"""`samebits verify --across dp=1,2,4`: the same training at several data-parallel sizes must
give the same bits.

Each size runs once (the reference recipe with ``grad_reduce=invariant``, or any command with
``{nproc}`` and ``{out}`` in it); then every run is compared with the first size's run by
the records of one rank (rank 0 by default) that are replicated under data parallelism:
parameters, reduced gradients, global metrics.  Streams of different world sizes cannot be
compared rank by rank (`samebits diff` refuses them), so `compare_replicated` matches one
rank's records by identity (kind, phase, name, occurrence) step by step.  A record that
only one layout has (a rank-local shard) is not comparable: listed, never counted as equal.

The verdict is proof or nothing: PASS only when every size finished and compared equal at
every step of the window; a run that failed is an error (exit 2), a missing step INCOMPLETE.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from samebits.compare import DiffResult, Divergence
from samebits.errors import ConfigError
from samebits.runs._launch import failed, run_logged
from samebits.runs.commands import (CKPT, NPROC, OUT, RUN, STEP, SelfRecording, fill_placeholders, holds,
                                    prepare_out_dir, write_summary)
from samebits.runs.verify import RunInfo
from samebits.stream import open_run
from samebits.stream.reader import require_same_digest_version
from samebits.verdicts import ToDict, Verdict

ACROSS_PLACEHOLDERS = (NPROC, OUT)  # in a command for --across: the rank count, the run's folder
_SPEC = re.compile(r"^\s*dp\s*=\s*(\d+(?:\s*,\s*\d+)*)\s*$")


def parse_across(spec: str) -> list[int]:
    """``"dp=1,2,4"`` -> [1, 2, 4] (distinct sizes, at least two, in the order given)."""
    match = _SPEC.match(spec or "")
    if not match:
        raise ConfigError(f"--across {spec!r}: expected dp=N,N,... (e.g. dp=1,2,4): the data-parallel sizes "
                          "to run and compare")
    sizes = [int(n) for n in match.group(1).split(",")]
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        raise ConfigError(f"--across {spec!r}: give at least two distinct positive data-parallel sizes")
    return sizes


def compare_replicated(a, b, *, rank: int = 0, start_step: int | None = None, stop_step: int | None = None,
                       phases: Iterable[str] | None = None) -> DiffResult:
    """Compare rank ``rank``'s records of runs ``a`` and ``b`` (of any world sizes) step by step,
    for start <= step < stop (stop None: to ``a``'s end).  Records are matched by identity;
    ``phases`` restricts to those phases.  A step of ``a`` that ``b`` lacks makes the verdict
    INCOMPLETE (DIVERGED if an earlier step differed); records that only one run holds are
    listed in the notes and not counted as compared."""
    start = 0 if start_step is None else start_step
    wanted = None if phases is None else set(phases)
    run_a, run_b = open_run(a), open_run(b)
    try:
        require_same_digest_version(run_a, run_b)  # digests of two versions never compare
        steps_a = _rank_steps(run_a, rank, start, stop_step, wanted)
        steps_b = _rank_steps(run_b, rank, start, stop_step, wanted)
    finally:
        run_a.close()
        run_b.close()
    compared = {"ranks": 1, "steps": 0, "records": 0, "rank": rank, "world_size_a": run_a.world_size,
                "world_size_b": run_b.world_size}
    notes, incomplete, only = [], [], set()
    first = None
    for step, records_a in steps_a.items():
        records_b = steps_b.get(step)
        if records_b is None:
            incomplete.append(f"step {step}: in {a} but not in {b} (rank {rank})")
            break
        compared["steps"] += 1
        for key, record in records_a.items():
            other = records_b.get(key)
            if other is None:
                only.add(f"{key[1]}/{key[2]} only in {a}")
                continue
            compared["records"] += 1
            if not record.same_content(other) and first is None:
                first = Divergence(step=step, rank=rank, reason="content", phase=key[1], name=key[2],
                                   occurrence=key[3], kind=key[0], a=record.to_dict(), b=other.to_dict(),
                                   records_differing=sum(1 for k, r in records_a.items() if k in records_b
                                                         and not r.same_content(records_b[k])),
                                   detail=f"{key[1]}/{key[2]}: {record.summary()} vs {other.summary()}")
        only.update(f"{key[1]}/{key[2]} only in {b}" for key in records_b if key not in records_a)
        if first is not None:
            break
    if only:
        notes.append(f"not comparable (held by one layout only, e.g. rank-local shards): "
                     f"{', '.join(sorted(only)[:6])}{' ...' if len(only) > 6 else ''}")
    if first is not None:
        verdict = Verdict.DIVERGED
    elif incomplete:
        verdict = Verdict.INCOMPLETE
    elif compared["records"] == 0:
        verdict = Verdict.INCOMPLETE
        incomplete.append(f"nothing to compare: rank {rank} of {a} holds no record in the window "
                          f"[{start}, {stop_step if stop_step is not None else 'end'}) that {b} also holds")
    else:
        verdict = Verdict.IDENTICAL
    return DiffResult(a=str(a), b=str(b), verdict=verdict, first_divergence=first,
                      ranks_diverged_first=[rank] if first else [], divergences={rank: first} if first else {},
                      compared=compared, notes=notes, incomplete=incomplete)


def _rank_steps(run, rank: int, start: int, stop: int | None, phases: set | None) -> dict[int, dict]:
    """{step: {record key: record}} of one rank in [start, stop), phases filtered."""
    out = {}
    for block in run.stream(rank).steps():
        if block.step < start or (stop is not None and block.step >= stop):
            continue
        out[block.step] = {r.key: r for r in block.records() if phases is None or r.phase in phases}
    return out


@dataclass
class AcrossResult(ToDict):
    """What ``verify --across`` found: each size's run and its comparison with the first size."""

    out: str
    sizes: list[int]
    checks: dict[int, DiffResult]  # size -> comparison with sizes[0]'s run
    runs: list[RunInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def verdict(self) -> Verdict:
        verdicts = [Verdict(c.verdict) for c in self.checks.values()]
        if Verdict.DIVERGED in verdicts:
            return Verdict.FAIL
        if not verdicts or any(v is not Verdict.IDENTICAL for v in verdicts):
            return Verdict.INCOMPLETE
        return Verdict.PASS

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "out": self.out, "sizes": self.sizes,
                "reference": f"dp={self.sizes[0]}",
                "checks": {f"dp={size}": check.to_dict() for size, check in self.checks.items()},
                "runs": [run.to_dict() for run in self.runs], "notes": self.notes,
                "timings_s": {k: round(v, 3) for k, v in self.timings.items()}}


def verify_across(sizes: list[int], cmd: list[str] | None = None, out=None, *,
                  programs: Mapping[int, SelfRecording] | None = None, rank: int = 0,
                  run_timeout: float | None = None, progress: Callable[[str], None] | None = None) -> AcrossResult:
    """Run the training at each data-parallel size in ``sizes`` and compare each with the first.

    ``cmd``: a command with ``{nproc}`` replaced by the size and ``{out}`` by the folder it must
    record into (e.g. ``torchrun --nproc-per-node {nproc} train.py --out {out}``).  Or
    ``programs``: a program that records itself, for each size (the reference recipe with
    ``grad_reduce=invariant`` and ``ep=1``: `samebits.recipes.commands`); each run also saves
    its checkpoint of step ``steps // 2`` into its folder's ckpt/, so that `samebits replay`
    can re-run a step of it.
    """
    if (cmd is None) == (programs is None):
        raise ConfigError("verify --across: give a command (with {nproc} and {out}) or the program of each size, "
                          "not both")
    if cmd is not None:
        missing = [p for p in ACROSS_PLACEHOLDERS if not holds(cmd, p)]
        if not cmd or missing:
            raise ConfigError(f"--across with a command: the command must contain {' and '.join(missing)} "
                              "({nproc}: the data-parallel size of each run; {out}: the folder it records "
                              "into), e.g. -- torchrun --nproc-per-node {nproc} train.py --out {out}")
    else:
        lacking = [size for size in sizes if size not in programs]
        if lacking:
            raise ConfigError(f"verify --across: no program for dp={lacking[0]}")
        programs[sizes[0]].refuse_early()  # the options and config, before any run and any folder
    out = prepare_out_dir(out, "across")
    say = progress or (lambda message: None)
    result = AcrossResult(out=str(out), sizes=list(sizes), checks={})
    for size in sizes:
        name = f"dp{size}"
        run_dir = out / name
        if cmd is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            argv = fill_placeholders(cmd, {NPROC: size, OUT: run_dir, RUN: name})
        else:
            program = programs[size]
            save_at = program.steps // 2
            template = program.save if save_at > 0 else program.record  # a checkpoint to replay from
            argv = fill_placeholders(template, {OUT: run_dir, STEP: save_at, CKPT: run_dir / "ckpt", RUN: name})
        say(f"running dp={size}: {shlex.join(argv)}")
        log = out / "logs" / f"{name}.log"
        code, seconds = run_logged(argv, log, label=name, timeout=run_timeout or 1800.0, progress=progress,
                                   streams=run_dir, steps=None if cmd is not None else programs[size].steps)
        result.timings[name] = seconds
        result.runs.append(RunInfo(name, shlex.join(argv), code, seconds))
        if code != 0:
            raise failed(name, argv, code, log)
    reference = out / f"dp{sizes[0]}"
    for size in sizes[1:]:
        say(f"comparing dp={size} with dp={sizes[0]} (rank {rank}'s replicated records)")
        result.checks[size] = compare_replicated(reference, out / f"dp{size}", rank=rank)
    write_summary(out, result)
    return result


__all__ = ["verify_across", "AcrossResult", "compare_replicated", "parse_across", "ACROSS_PLACEHOLDERS"]
