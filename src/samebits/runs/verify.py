"""`samebits verify`: check the two guarantees by running the training three times.

* A and B: two independent runs from the same initial state must be bitwise identical
  at every step (guarantee 1, "independent").
* C: a fresh process resumes from A's checkpoint at step k and runs to the end; from step
  k on it must be bitwise identical to A (guarantee 2, "resume").  On the reference recipe
  A saves at step k and trains on, as a job that checkpoints does, and B never saves, so
  A = B also shows that saving leaves a run as it was.

B and C check themselves live against A's step roots and stop at the first divergent
step, so no compute is spent after the answer is known; with ``keep_going`` (``--keep-going``)
they run to the end, so the whole divergent curves can be seen (`samebits report`).  The same
check runs on the built-in reference recipe or, through zero-code recording, on any command.

The verdict is proof or nothing: PASS only when every guarantee checked compared identical
records and every run finished (a run that raised is a failed run, exit 2); the result names
the guarantees it checked and those it did not.  When a resumed run differs, the state census
recorded at each step start names the state the checkpoint did not restore.
"""

from __future__ import annotations

import os
import re
import shlex
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from samebits.autorecord import environment_for, read_gaps, read_stop, recording_variables, summarise_gaps, with_variables
from samebits.checkpoint import CENSUS_DIR
from samebits.compare import DiffResult, diff
from samebits.errors import ConfigError, IncomparableRunsError
from samebits.runs._explain import Finding, explain_independent, explain_resume, ordered
from samebits.runs._launch import RunFailed, judge_recipe_run, judge_recorded_run, run_logged, stopped_marked
from samebits.runs.commands import (CKPT, OUT, REFERENCE, STEP, SelfRecording, fill_placeholders,
                                    prepare_out_dir, write_summary)
from samebits.verdicts import ToDict, Verdict, milliseconds, serialised

GUARANTEES = ("independent", "resume")
PLACEHOLDERS = ("{out}", "{run}")  # in the command: this run's own work folder and its name
RESUME_PLACEHOLDERS = ("{step}", "{from}")  # in --resume-with only: the resume step, A's work folder


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


def verify_recipe(
    program: SelfRecording,
    out=None,
    *,
    resume_at: int | None = None,
    progress: Callable[[str], None] | None = None,
    record: dict | None = None,
    keep_going: bool = False,
) -> VerifyResult:
    """Run a program that records itself (the reference recipe: ``program`` from
    `samebits.recipes.commands.recipe_roles`) as A (saves at ``resume_at``, default
    ``steps // 2``, and trains on), B (never saves) and C (resumes A's checkpoint) and compare.
    Both guarantees are always checked.  ``record``: what to record
    (`samebits.autorecord.recording_variables`' arguments).  ``keep_going``: B and C are not
    checked live (and not stopped at their first divergent step): they run to the end."""
    steps = program.steps
    if steps < 2:
        raise ConfigError(f"--steps {steps}: verify needs at least 2 steps (one before and one after the resume).")
    resume_at = steps // 2 if resume_at is None else resume_at
    if not 0 < resume_at < steps:
        raise ConfigError(f"--resume-at {resume_at} must be between 1 and {steps - 1} (inside the run).")
    env = with_variables(os.environ, recording_variables(**record)) if record else None
    program.refuse_early()  # a config the program refuses is refused before any run (and any folder)
    out = prepare_out_dir(out, "verify")
    say = progress or (lambda message: None)
    # A saves at the resume step and trains on, as a job that checkpoints does; B never saves
    # (so A = B also says that saving leaves the run as it was); C resumes A's checkpoint.
    values = {STEP: resume_at, CKPT: out / "ckpt", REFERENCE: out / "a"}
    live = () if keep_going else program.live_check  # the live check stops B and C at a difference
    stages = [
        ("A", fill_placeholders(program.save, {**values, OUT: out / "a"}), False),
        ("B", fill_placeholders(program.record + live, {**values, OUT: out / "b"}), True),
        ("C (resume)", fill_placeholders(program.resume + live, {**values, OUT: out / "c"}), True),
    ]
    timings: dict[str, float] = {}
    runs: list[RunInfo] = []
    with stopped_marked(out, runs) as mark:  # a killed verify leaves summary.json saying so (issue 34)
        for index, (name, argv, may_stop) in enumerate(stages, 1):
            say(f"[{index}/{len(stages)}] run {name}: {program.nproc} rank(s), {steps} steps ...")
            run_dir = out / name[0].lower()
            log = out / "logs" / (name.split()[0].lower() + ("-resume" if "resume" in name else "") + ".log")
            code, seconds = run_logged(argv, log, label=name, env=env, progress=progress, streams=run_dir,
                                       steps=steps - resume_at if name.startswith("C") else steps)  # C: from resume_at
            timings[name] = seconds
            # torchrun replaces the recipe's exit code 3 by its own: the marker file tells.
            stop = read_stop(run_dir) if may_stop else None
            with _keeping_earlier_verdicts(out, runs):
                judge_recipe_run(name, argv, code, log, stopped=stop is not None)
            ended = f"stopped at step {stop.get('stopped_at')} (differs from A)" if stop is not None else "finished"
            runs.append(RunInfo(name, shlex.join(argv), code, seconds, ended))
            mark()  # what it had so far, should verify itself be killed next
            say(f"      done in {seconds:.1f} s" + (" (stopped at its first divergent step)" if stop else ""))
    say("comparing ...")
    notes: list[str] = []
    checks = {
        "independent": _with_census(_diff(out / "a", out / "b"), out / "a", out / "b", None, "independent", notes),
        "resume": _with_census(_diff(out / "a", out / "c", start_step=resume_at), out / "a", out / "c",
                               resume_at, "resume", notes),
    }
    notes += _curves_cut(runs)
    result = VerifyResult(str(out), checks, timings, resume_at, notes, runs)
    _add_gaps(result, {"a": out / "a", "b": out / "b", "c": out / "c"})
    _explain(result, out / "a", out / "b", out / "c")
    if program.bisect_words:
        result.bisect_command = shlex.join(program.bisect_words)
        result.resume_bisect_command = shlex.join([*program.bisect_words, "--resume-at", str(resume_at)])
    write_summary(out, result)
    return result


def _diff(a: Path, b: Path, start_step: int | None = None) -> DiffResult:
    """`diff` of two of verify's runs.  Runs that cannot be compared (other configs, other
    recorded names) give no verdict (exit 2); the advice then names the command that shows
    their differences anyway, since verify itself takes no --allow-config-diff (issue 33)."""
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
    """A program that records itself writes the census of its whole training state (random
    states, optimizer and scheduler progress: `checkpoint.CENSUS_DIR`), so for it a state that
    differs is a difference of the runs even while no output differs yet (a generator the
    resume lost that the run draws from later).  When every output is identical and both runs
    have a census, the census decides: its divergence is the check's result, said in a note.
    (Zero-code recording's census is evidence, not part of the verdict: an unseeded generator
    a program never draws from differs between any two processes.)"""
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


def verify_command(
    cmd: list[str],
    out=None,
    *,
    resume_with: str | None = None,
    resume_at: int | None = None,
    require_resume: bool = False,
    progress: Callable[[str], None] | None = None,
    steps: str | None = None,
    run_timeout: float | None = None,
    record: dict | None = None,
    keep_going: bool = False,
) -> VerifyResult:
    """Run ``cmd`` twice (A, B) with zero-code recording and compare; with ``resume_with``
    (a command run after A, resuming A's checkpoint of step ``resume_at``) also run C and
    check it equals A from that step on.

    Placeholders, expanded per run so that no two runs share a folder: ``{out}`` (this run's
    own empty work folder, OUT/work/a|b|c, for its checkpoints and outputs) and ``{run}``
    (a, b or c) in both commands; ``{step}`` (``resume_at``) and ``{from}`` (A's work folder,
    where A saved its checkpoints) in ``resume_with``.  C's steps are numbered from
    ``resume_at``, like A's.  ``require_resume``: refuse to start without a resume check.
    ``record``: what to record (`samebits.autorecord.recording_variables`' arguments; ``steps``
    is the step window, kept as its own argument too).  ``keep_going``: B and C are not checked
    live against A, so they run every step even after they differ.
    """
    if not cmd:
        raise ConfigError("no command given: write `samebits verify -- python train.py ...`.")
    if resume_with is None and require_resume:
        raise ConfigError("--require-resume: no resume check asked for. Give --resume-with 'CMD' (how to resume "
                          "your script from A's checkpoint: {from} is A's work folder, {step} the step) and "
                          "--resume-at K; see docs/resume.md.")
    if resume_with is not None and resume_at is None:
        raise ConfigError("--resume-with needs --resume-at K: the step the resumed command starts from "
                          "(there is no default for a command: samebits cannot know where it checkpoints).")
    if resume_at is not None and resume_at < 1:
        raise ConfigError(f"--resume-at {resume_at}: must be a step >= 1 (a resume after at least one step).")
    if resume_at is not None and resume_with is None:
        raise ConfigError("--resume-at without --resume-with: give the command that resumes your script too.")
    for placeholder in RESUME_PLACEHOLDERS:
        if any(placeholder in part for part in cmd):
            raise ConfigError(f"the command holds {placeholder}, which only --resume-with can use; use {{out}} "
                              "for the run's own work folder.")
    what = dict(record or {})
    if steps is not None:
        what["steps"] = steps
    recording_variables(**what)  # a bad choice is refused before any run starts
    out = prepare_out_dir(out, "verify")
    say = progress or (lambda message: None)
    command = shlex.join(cmd)
    reference = None if keep_going else out / "a"  # the live check stops B and C at a difference
    notes: list[str] = []
    stages = [("A", _expand(cmd, out, "a"), environment_for(out / "a", command=command, **what)),
              ("B", _expand(cmd, out, "b"),
               environment_for(out / "b", command=command, reference=reference, **what))]
    if resume_with is not None:
        resumed = _expand(shlex.split(resume_with), out, "c", step=resume_at)
        stages.append(("C (resume)", resumed,
                       environment_for(out / "c", command=command, step_offset=resume_at, **what,
                                       reference=reference)))
        if not any("{out}" in part for part in cmd):
            notes.append("the command has no {out}: A and B write their checkpoints to the same place, so C may "
                         "resume from B's; put {out} in the command's checkpoint folder and {from} in "
                         "--resume-with (docs/resume.md)")
    timings: dict[str, float] = {}
    runs: list[RunInfo] = []
    with stopped_marked(out, runs) as mark:  # a killed verify leaves summary.json saying so (issue 34)
        for index, (name, argv, env) in enumerate(stages, 1):
            say(f"[{index}/{len(stages)}] run {name}: {shlex.join(argv)}")
            log = out / "logs" / (name.split()[0].lower() + ".log")
            run_dir = Path(env["SAMEBITS_DIR"])
            kwargs = {"timeout": run_timeout} if run_timeout is not None else {}
            code, seconds = run_logged(argv, log, env=env, label=name, progress=progress, streams=run_dir, **kwargs)
            timings[name] = seconds
            stop = read_stop(run_dir)
            with _keeping_earlier_verdicts(out, runs):
                if stop is not None:
                    ended = f"stopped at step {stop.get('stopped_at')} (differs from A)"
                else:
                    ended = judge_recorded_run(name, argv, code, run_dir, log) or "finished"
                runs.append(RunInfo(name, shlex.join(argv), code, seconds, ended))
                mark()  # what it had so far, should verify itself be killed next
                say(f"      done in {seconds:.1f} s: {ended}")
                _refuse_unrecorded(name, argv, run_dir)
    checks = {"independent": _diff(out / "a", out / "b"),
              "resume": _diff(out / "a", out / "c", start_step=resume_at) if resume_with else None}
    notes += _curves_cut(runs)
    result = VerifyResult(str(out), checks, timings, resume_at, notes, runs)
    _add_gaps(result, {"a": out / "a", "b": out / "b", "c": out / "c"})
    _explain(result, out / "a", out / "b", out / "c")
    result.bisect_command = _recording_prefix(what) + "samebits bisect -- " + command  # bisect fills {out}, {run}
    if resume_with is not None:
        result.resume_bisect_command = resume_bisect_command(cmd, shlex.split(resume_with), resume_at, what)
    write_summary(out, result)
    return result


def resume_bisect_command(cmd: list[str], resume_with: list[str], resume_at: int,
                          record: dict | None = None) -> str:
    """The `samebits bisect` command that locates the origin of a resume divergence: A is the
    command, B the resume command, numbered from ``resume_at``.  The placeholders stay in it:
    bisect fills them per run as verify does, every run in a new work folder of its own
    (``{out}``: a trainer that resumes from the latest checkpoint in its output folder starts
    clean), every B resuming the checkpoints of the bisect's first A (``{from}``, ``{step}``).
    ``record``: verify's choice of what to record (``--exclude`` ...), given to bisect as the
    variables it reads."""
    return _recording_prefix(record) + shlex.join(["samebits", "bisect", "--a", _join(cmd), "--b", _join(resume_with),
                                                   "--b-step-offset", str(resume_at)])


def _join(argv: list[str]) -> str:
    """`shlex.join` that leaves a placeholder's braces unquoted (the words go inside a quoted
    --a/--b, where no shell expands them)."""
    return " ".join(word if re.fullmatch(r"[\w@%+=:,./{}-]+", word) else shlex.quote(word) for word in argv)


def _recording_prefix(record: dict | None) -> str:
    """``VAR=value `` for each ``SAMEBITS_*`` variable of what verify recorded (``--exclude``
    ...), which bisect reads for every run; its step window is bisect's own."""
    chosen = sorted((name, value) for name, value in recording_variables(**(record or {})).items()
                    if value is not None and name != "SAMEBITS_STEPS")
    return "".join(shlex.quote(f"{name}={value}") + " " for name, value in chosen)


def _expand(argv: list[str], out: Path, run: str, step: int | None = None) -> list[str]:
    """``argv`` with the placeholders of run ``run`` filled in; its work folder is created."""
    work = (out / "work" / run).absolute()  # absolute: the program may change its folder, or want one
    work.mkdir(parents=True, exist_ok=True)
    values = {"{out}": str(work), "{run}": run}
    if step is not None:
        values.update({"{step}": str(step), "{from}": str((out / "work" / "a").absolute())})
    return fill_placeholders(argv, values)


_STOPPED_AT = re.compile(r"stopped at (step \S+)")


def _curves_cut(runs: list[RunInfo]) -> list[str]:
    """The note for runs the live check stopped at their first divergent step: their curves
    end there, so a report shows a point or two of them; ``--keep-going`` records them whole."""
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
    """A run that fails (`RunFailed`, exit 2) after A and B ran: its error keeps the verdict
    those runs already give (issue 35).  A B that stopped at its first divergent step is
    often the root cause of what fails after it (a C resuming from a run that differs from
    its own twin), and an error that shows only the last run's failure hides it."""
    try:
        yield
    except RunFailed as err:
        earlier = _earlier_verdicts(out, runs, f"run {err.label or '?'} failed (its error below); before it")
        if not earlier:
            raise
        raise RunFailed("\n".join(earlier + [str(err)]), err.reason, err.label) from err


def _earlier_verdicts(out: Path, runs: list[RunInfo], before: str = "before it") -> list[str]:
    """What A and B, both ended, already say: whether they are identical (guarantee 1), and
    where and why they differ when they do, as lines for an error message; [] when they did not
    both end.  ``before``: the words each first line starts with."""
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


def _refuse_unrecorded(name: str, argv: list[str], run_dir: Path) -> None:
    """A run in which samebits could not start recording at all (a ``startup`` gap and no
    stream) has nothing to compare: exit 2 with what failed, never a comparison of nothing."""
    gaps = [gap for gap in read_gaps(run_dir) if gap.get("site") == "startup"]
    if gaps and not any(run_dir.glob("rank-*.sbs")):
        raise RunFailed(f"run {name} ran ({shlex.join(argv)}) but samebits could not record it: "
                        f"{gaps[0].get('error')}. {summarise_gaps(gaps)}.", "samebits could not record", name)


def _add_gaps(result: VerifyResult, run_dirs: dict[str, Path]) -> None:
    """What samebits could not record in each run (`read_gaps`): the first gapped step of each
    check whose runs have a gap in the records it compares, and one line in the notes."""
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
    differs in the state census at the step start (`samebits.runs._explain`)."""
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


__all__ = ["verify_recipe", "verify_command", "VerifyResult", "RunInfo", "GUARANTEES"]
