"""`samebits verify`: check the two guarantees by running the training three times.

A and B, two independent runs, must be bitwise identical ("independent"); C, a fresh process
resumed from A's checkpoint at step k, must equal A from k on ("resume").  B and C check
themselves live against A and stop at the first divergent step (``keep_going``: run to the
end).  PASS only when every checked guarantee compared identical and every run finished; a
resumed run that differs is explained by the state census (`_explain`).  docs/resume.md.
"""

from __future__ import annotations

import re
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from samebits.autorecord import read_gaps, read_stop, summarise_gaps
from samebits.checkpoint import CENSUS_DIR
from samebits.compare import DiffResult, diff
from samebits.errors import IncomparableRunsError
from samebits.runners._explain import Finding, explain_independent, explain_resume, ordered
from samebits.runners._launch import RunFailed, run_logged, stopped_marked
from samebits.runners.commands import CKPT, FROM, STEP, prepare_out_dir, write_summary
from samebits.runners.program import RECORD, RESUME, SAVE, Program
from samebits.verdicts import ToDict, Verdict, milliseconds, serialised

GUARANTEES = ("independent", "resume")


@dataclass
class RunInfo(ToDict):
    """One launched run: its command, how it ended, and how long it took."""

    name: str
    command: str
    exit_code: int
    seconds: float = field(metadata=serialised(convert=milliseconds))
    ended: str = "finished"  # "finished" | "stopped at step K (...)" | a tolerated crash


@dataclass
class VerifyResult(ToDict):
    """What verify found.  ``checks`` maps each guarantee to its `DiffResult`, or None when it
    was not checked; ``verdict`` is a `Verdict`: PASS (every check identical), FAIL (a check
    diverged), INCOMPLETE (a check could not decide, or nothing was checked)."""

    summary_of = "verify"  # its summary.json names the command that wrote it
    dict_keys = ("verdict", "checked", "not_checked", "out", "resume_at", "checks", "gaps", "explanations", "findings",
                 "runs", "bisect_command", "resume_bisect_command", "timings_s", "notes")

    out: str
    checks: dict[str, DiffResult | None]
    timings: dict[str, float] = field(metadata=serialised(key="timings_s", convert=milliseconds))
    resume_at: int | None
    notes: list[str] = field(default_factory=list)
    runs: list[RunInfo] = field(default_factory=list)
    explanations: dict[str, list[str]] = field(default_factory=dict)  # check -> what state differed
    findings: list[Finding] = field(default_factory=list)  # the same, as claims: most specific first
    bisect_command: str = ""  # how to locate the origin op of an independent-runs divergence
    resume_bisect_command: str = ""  # the same for a resume divergence (A against the resumed run)
    #: check -> the first step from which its runs have records samebits could not write (a
    #: gap, `samebits.stream.gaps`; -1: the whole run; None: only the state census or the
    #: tracking of state): no PASS while any is there, and no divergence from that step on
    gaps: dict[str, int | None] = field(default_factory=dict)

    @property
    def checked(self) -> list[str]:
        return [name for name, check in self.checks.items() if check is not None]

    @property
    def not_checked(self) -> list[str]:
        return [name for name, check in self.checks.items() if check is None]

    def check_verdict(self, name: str) -> Verdict | None:
        """Check ``name``'s verdict, with its gaps: identical records are no proof where samebits
        could not record, and a divergence at or after a gap may be the gap's own making."""
        check = self.checks.get(name)
        if check is None:
            return None
        verdict = Verdict(check.verdict)
        if name not in self.gaps:
            return verdict
        if verdict is Verdict.IDENTICAL:
            return Verdict.INCOMPLETE
        gap, first = self.gaps[name], check.first_divergence
        if verdict is Verdict.DIVERGED and gap is not None and (first is None or first.step is None
                                                                or first.step >= gap):
            return Verdict.INCOMPLETE
        return verdict

    @property
    def verdict(self) -> Verdict:
        verdicts = [self.check_verdict(name) for name, check in self.checks.items() if check is not None]
        if Verdict.DIVERGED in verdicts:
            return Verdict.FAIL  # a divergence is proof, whatever else could not be decided
        if not verdicts or any(v is not Verdict.IDENTICAL for v in verdicts):
            return Verdict.INCOMPLETE
        return Verdict.PASS

    def dict_extras(self) -> dict:
        return {"verdict": self.verdict, "checked": self.checked, "not_checked": self.not_checked}


def verify(
    program: Program,
    out=None,
    *,
    resume_at: int | None = None,
    require_resume: bool = False,
    progress: Callable[[str], None] | None = None,
    run_timeout: float | None = None,
    keep_going: bool = False,
) -> VerifyResult:
    """Run ``program`` as A (saves at ``resume_at`` and trains on), B (never saves, so A = B also
    says saving leaves a run as it was) and, when it resumes, C (resumes A's checkpoint of
    ``resume_at``, its steps numbered from there), and compare.  ``keep_going``: B and C are not
    stopped at their first divergent step.  Each run has its own work folder (OUT/work/a|b|c)."""
    resume_at = program.verify_resume_step(resume_at, require_resume)
    program.refuse_early()  # a config the program refuses is refused before any run (and any folder)
    out = prepare_out_dir(out, "verify")
    say = progress or (lambda message: None)
    reference = None if keep_going else out / "a"  # the live check stops B and C at a difference
    values = {STEP: resume_at, CKPT: out / "ckpt", FROM: (out / "work" / "a").absolute()}
    stages = [("A", SAVE, None, None), ("B", RECORD, reference, None)]
    if program.resumes:
        stages.append(("C (resume)", RESUME, reference, resume_at))
    timings: dict[str, float] = {}
    runs: list[RunInfo] = []
    with stopped_marked(out, runs) as mark:  # a killed verify leaves summary.json saying so (issue 34)
        for index, (name, role, live, offset) in enumerate(stages, 1):
            run = name[0].lower()
            launch = program.launch(role, out / run, work=(out / "work" / run).absolute(), values=values,
                                    reference=live, step_offset=offset)
            say(f"[{index}/{len(stages)}] run {name}: {program.describe(launch)}")
            steps = None if program.steps is None else program.steps - (offset or 0)  # C: from resume_at
            code, seconds = run_logged(launch.argv, out / "logs" / f"{run}.log", env=launch.env, label=name,
                                       progress=progress, streams=launch.streams, steps=steps,
                                       **({} if run_timeout is None else {"timeout": run_timeout}))
            timings[name] = seconds
            # torchrun replaces the recipe's exit code 3 by its own: the marker file tells.
            stop = read_stop(launch.streams) if live is not None else None
            with _keeping_earlier_verdicts(out, runs):
                ended = f"stopped at step {stop.get('stopped_at')} (differs from A)" if stop is not None else \
                    program.judge(name, launch, code, out / "logs" / f"{run}.log") or "finished"
            runs.append(RunInfo(name, shlex.join(launch.argv), code, seconds, ended))
            mark()  # what it had so far, should verify itself be killed next
            say(f"      done in {seconds:.1f} s: {ended}")
    say("comparing ...")
    notes = program.notes()
    checks = {"independent": _judged(program, out / "a", out / "b", None, "independent", notes),
              "resume": _judged(program, out / "a", out / "c", resume_at, "resume", notes)
              if program.resumes else None}
    notes += _curves_cut(runs)
    result = VerifyResult(str(out), checks, timings, resume_at, notes, runs)
    _add_gaps(result, {"a": out / "a", "b": out / "b", "c": out / "c"})
    _explain(result, out / "a", out / "b", out / "c")
    result.bisect_command, result.resume_bisect_command = program.bisect_commands(resume_at)
    write_summary(out, result)
    return result


def _judged(program: Program, a: Path, b: Path, start_step: int | None, name: str, notes: list[str]) -> DiffResult:
    """One check: `_diff` of its runs, and for a program whose census decides, `_with_census`."""
    check = _diff(a, b, start_step=start_step)
    return _with_census(check, a, b, start_step, name, notes) if program.census_decides else check


def _diff(a: Path, b: Path, start_step: int | None = None) -> DiffResult:
    """`diff` of two of verify's runs; for runs that cannot be compared, the advice names the
    `samebits diff` that shows their differences anyway (verify takes no --allow-config-diff)."""
    try:
        return diff(a, b, start_step=start_step)
    except IncomparableRunsError as err:
        message, _, advice = str(err).rpartition("\n")
        if "--allow-config-diff" not in advice:  # compare's advice is for `samebits diff`, which takes it
            message = str(err)
        words = ["samebits", "diff", str(a), str(b), "--allow-config-diff"]
        if start_step is not None:
            words[4:4] = ["--from-step", str(start_step)]
        raise IncomparableRunsError(f"{message}\nverify compares only runs that record the same things; to see "
                                    f"where they differ anyway, run `{shlex.join(words)}`", err.differences) from err


def _with_census(check: DiffResult, a: Path, b: Path, start_step: int | None, name: str,
                 notes: list[str]) -> DiffResult:
    """When every output is identical, a self-recording program's census decides: state that
    differs (a generator the resume lost, drawn from later) is a difference of the runs, said
    in a note.  (Zero-code recording's census is evidence only: `Program.census_decides`.)"""
    if Verdict(check.verdict) is not Verdict.IDENTICAL or not ((a / CENSUS_DIR).is_dir() and (b / CENSUS_DIR).is_dir()):
        return check
    census = diff(a / CENSUS_DIR, b / CENSUS_DIR, start_step=start_step)
    if Verdict(census.verdict) is not Verdict.DIVERGED:
        return check
    first = census.first_divergence
    notes.append(f"{name}: every recorded output is identical, but the state census differs at step {first.step}, "
                 f"rank {first.rank} ({first.name}): the runs' training state is not the same (lost or "
                 "changed state that no output has shown yet)")
    return census


_STOPPED_AT = re.compile(r"stopped at (step \S+)")


def _curves_cut(runs: list[RunInfo]) -> list[str]:
    """The note for runs the live check stopped at their first divergent step: their curves end there."""
    cut = [run for run in runs if run.ended.startswith("stopped at step")]
    if not cut:
        return []
    which = " and ".join(run.name.split()[0] + " at " + _STOPPED_AT.match(run.ended).group(1) for run in cut)
    return [f"the live check stopped {which} (the first divergent step{'s' if len(cut) > 1 else ''}), so "
            f"{'their curves end' if len(cut) > 1 else 'its curve ends'} there: to see the whole divergent curves "
            "(`samebits report`), run verify again with --keep-going"]


_CHECK_RUNS = {"independent": ("a", "b"), "resume": ("a", "c")}


@contextmanager
def _keeping_earlier_verdicts(out: Path, runs: list[RunInfo]):
    """A run that fails after A and B ran keeps, in its error, the verdict they already give
    (issue 35): their divergence is often the root cause of what fails after it."""
    try:
        yield
    except RunFailed as err:
        earlier = _earlier_verdicts(out, runs, f"run {err.label or '?'} failed (its error below); before it")
        if not earlier:
            raise
        raise RunFailed("\n".join(earlier + [str(err)]), err.reason, err.label) from err


def _earlier_verdicts(out: Path, runs: list[RunInfo], before: str = "before it") -> list[str]:
    """What A and B, both ended, already say of guarantee 1, as lines for an error message ([]
    when they did not both end); ``before`` starts the first line."""
    ended = {run.name: run for run in runs}
    if "A" not in ended or "B" not in ended:
        return []
    stopped = " (B stopped there: its live check found it)" if ended["B"].ended.startswith("stopped") else ""
    try:
        check = diff(out / "a", out / "b")
    except Exception as err:  # noqa: BLE001 - an error message must not fail on its context
        return [f"{before}, A and B ran ({', '.join(f'{n} {r.ended}' for n, r in ended.items())}) but could not be "
                f"compared ({str(err).splitlines()[0] if str(err) else type(err).__name__})"]
    verdict = Verdict(check.verdict)
    if verdict is Verdict.IDENTICAL:
        c = check.compared
        return [f"{before}, the independent runs A and B were identical ({c['ranks']} rank(s) x {c['steps']} step(s), "
                f"{c['records']:,} records): guarantee 1 held"]
    if verdict is not Verdict.DIVERGED or check.first_divergence is None:
        return [f"{before}, the independent runs A and B were {verdict.value.upper()} "
                f"({'; '.join(check.incomplete[:1] or check.notes[:1]) or 'no verdict'})"]
    first = check.first_divergence
    where = f"{first.phase}/{first.name}" if first.name else first.detail
    lines = [f"{before}, the independent runs A and B diverged at step {first.step}, rank {first.rank} ({where})"
             f"{stopped}: guarantee 1 fails whatever the later run does, and a run from A's checkpoint inherits what "
             "made them differ"]
    try:
        order = first.detail if first.reason == "order" else None
        findings = ordered(explain_independent(out / "a", out / "b", first.step, order, first.phase, first.rank))
    except Exception:  # noqa: BLE001 - the divergence stands without its explanation
        findings = []
    lines += [f"  what differs: step {f.step}, rank {f.rank}: {f.says}" for f in findings[:3]]
    return lines


def _add_gaps(result: VerifyResult, run_dirs: dict[str, Path]) -> None:
    """Each check's first step samebits could not record in its runs (`read_gaps`), and a note."""
    gaps = {run: read_gaps(path) for run, path in run_dirs.items()}
    found = [gap for run in gaps.values() for gap in run]
    if not found:
        return
    for name, check in result.checks.items():
        if check is None:
            continue
        mine = [gap for run in _CHECK_RUNS.get(name, ()) for gap in gaps.get(run, ())]
        steps = [gap.get("step") for gap in mine if gap.get("verdict", True)]
        if steps:
            result.gaps[name] = min(step if isinstance(step, int) else -1 for step in steps)
        elif mine:
            result.gaps[name] = None  # the census or the tracking only: no PASS, divergences stand
    result.notes.insert(0, summarise_gaps(found) + "; no verdict rests on what is missing")


def _explain(result: VerifyResult, run_a: Path, run_b: Path, run_c: Path) -> None:
    """Fill ``result.findings`` and ``result.explanations``: for each check that diverged, what
    differs in the state census at the step start (`samebits.runners._explain`)."""
    findings: list[Finding] = []
    independent = result.checks.get("independent")
    if independent is not None and independent.first_divergence is not None and not independent.identical:
        first = independent.first_divergence
        order = first.detail if first.reason == "order" else None
        findings += explain_independent(run_a, run_b, first.step, order, first.phase, first.rank)
    resume = result.checks.get("resume")
    if resume is not None and resume.first_divergence is not None and not resume.identical:
        findings += explain_resume(run_a, run_b, run_c, result.resume_at or 0, resume.first_divergence.step)
    result.findings = ordered(findings)
    explanations: dict[str, list[str]] = {}
    for finding in result.findings:
        explanations.setdefault(finding.check, []).append(f"step {finding.step}, rank {finding.rank}: {finding.says}")
    result.explanations = explanations


__all__ = ["verify", "VerifyResult", "RunInfo", "GUARANTEES"]
