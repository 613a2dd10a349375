"""The program a runner runs: one protocol, two kinds (the counterpart of torchtitan's `TrainSpec`).

verify, bisect, tax and ``verify --across`` are each written once over `Program`: for a role
the program gives the run to launch (`Launch`) and judges how it ended (`Program.judge`).

    RECORD     train, recording into the run's stream folder
    SAVE       the same, also saving the checkpoint of step {step} into {ckpt} on the way
    SAVE_ONLY  train to step {step}, save its checkpoint into {ckpt} and exit (records nothing)
    RESUME     resume the checkpoint {ckpt} (a command: its own resume command) and train on

`SelfRecording` records its own streams (the reference recipe; its census is part of verify's
verdict, and it is judged by its exit status); `ZeroCode` is any command under zero-code
recording (its census is evidence only, and it is judged by how each process's own code ended).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from samebits.autorecord import environment_for, read_gaps, recording_variables, summarise_gaps, with_variables
from samebits.errors import ConfigError, SamebitsError
from samebits.runners._launch import RunFailed, failed, judge_recorded_run
from samebits.runners.commands import (CHECK_TIMEOUT_S, FROM, OUT, REFERENCE, RUN, STEP, RecipeRefused,
                                    check_resume_options, check_verify_steps, fill_placeholders, holds)

RECORD, SAVE, SAVE_ONLY, RESUME = "record", "save", "save_only", "resume"


@dataclass(frozen=True)
class Launch:
    """One run to start: its argv, its environment (None: the caller's) and its stream folder."""

    argv: list[str]
    env: dict[str, str] | None
    streams: Path


class Program(Protocol):
    """What every runner needs of the training it runs (see the module docstring).  ``steps`` and
    ``nproc`` None: a command's own, unknown to samebits; ``census_decides``: whether its state
    census is part of a verdict; ``resumes``: whether it has a RESUME role."""

    steps: int | None
    nproc: int | None
    census_decides: bool

    @property
    def resumes(self) -> bool: ...

    def refuse_early(self) -> None:
        """Refuse options the program refuses, before any run (and any folder)."""

    def template(self, role: str) -> tuple[str, ...]:
        """The role's argv with its placeholders (what a result shows as the command)."""

    def launch(self, role: str, streams: Path, *, work: Path | None = None, values: Mapping[str, object] = {},
               reference: Path | None = None, step_offset: int | None = None,
               from_step: int | None = None) -> Launch:
        """The run of ``role`` recording into ``streams``: ``work`` its own work folder (a
        command's ``{out}``), ``values`` placeholders, ``reference`` a run to check each step
        against live, ``step_offset`` the first step of a resumed run, ``from_step`` record only
        steps >= it."""

    def judge(self, label: str, launch: Launch, code: int, log: Path) -> str | None:
        """How a run that exited with ``code`` ended: None (finished), a line for the verdict's
        table (a tolerated end), or `RunFailed`."""

    def describe(self, launch: Launch) -> str:
        """The run in a few words, for progress."""

    def verify_resume_step(self, resume_at: int | None, require_resume: bool) -> int | None:
        """verify's resume step (None: resume not checked), refusing what cannot be checked."""

    def bisect_commands(self, resume_at: int | None) -> tuple[str, str]:
        """verify's hints: the `samebits bisect` command of an independent-runs divergence and of
        a resume divergence at ``resume_at`` ("" where there is none)."""

    def notes(self) -> list[str]:
        """What a verdict on this program should say of it."""


@dataclass(frozen=True)
class SelfRecording:
    """A training program that records its own fingerprint streams, as command templates whose
    ``{out}`` is the run's stream folder.  ``steps``/``nproc`` None: a command whose steps samebits
    does not know (``verify --across`` runs one); ``recording``: `recording_variables`' arguments."""

    steps: int | None
    nproc: int | None
    record: tuple[str, ...]  # train ``steps`` steps, recording into {out}
    save: tuple[str, ...] = ()  # the same, also saving its checkpoint of step {step} into {ckpt} on the way
    save_only: tuple[str, ...] = ()  # train to step {step}, save its checkpoint into {ckpt} and exit
    resume: tuple[str, ...] = ()  # resume the checkpoint {ckpt} and train to ``steps``, recording into {out}
    live_check: tuple[str, ...] = ()  # words that make a recording run check each step against {reference}
    check: tuple[str, ...] | None = None  # checks the options, trains nothing: non-zero exit refuses them
    bisect_words: tuple[str, ...] = ()  # the `samebits bisect` command of the same program (verify's hint)
    recording: Mapping[str, object] = field(default_factory=dict)
    census_decides = True

    def __post_init__(self):
        if (self.steps is not None and self.steps < 1) or (self.nproc is not None and self.nproc < 1):
            raise ConfigError(f"a run of {self.steps} step(s) on {self.nproc} rank(s): both must be at least 1.")
        for name in ("record", "save", "resume"):
            if (name == "record" or getattr(self, name)) and not holds(getattr(self, name), OUT):
                raise ConfigError(f"the {name} command of a program that records itself has no {OUT} (where it "
                                  f"records): {shlex.join(getattr(self, name))}")

    @property
    def resumes(self) -> bool:
        return bool(self.resume)

    def refuse_early(self) -> None:
        """Run ``check`` (if any) and raise `RecipeRefused` with the program's own last line of
        complaint when it exits non-zero: a config it refuses is refused before any run."""
        recording_variables(**self.recording)  # a bad choice of what to record, before any run
        if self.check is None:
            return
        try:
            proc = subprocess.run(list(self.check), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SamebitsError(f"checking the program's options did not finish ({shlex.join(self.check)})") from None
        except FileNotFoundError:
            raise SamebitsError(f"cannot run {self.check[0]!r}: no such program") from None
        if proc.returncode != 0:
            said = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            raise RecipeRefused(said[-1] if said else f"exit code {proc.returncode}")

    def template(self, role: str) -> tuple[str, ...]:
        return {RECORD: self.record, SAVE: self.save, SAVE_ONLY: self.save_only, RESUME: self.resume}[role]

    def launch(self, role: str, streams: Path, *, work: Path | None = None, values: Mapping[str, object] = {},
               reference: Path | None = None, step_offset: int | None = None,
               from_step: int | None = None) -> Launch:
        """It records itself into ``streams``; the live check is its own words (``live_check``);
        it numbers its resumed steps itself (``step_offset`` unused)."""
        argv = self.template(role) + (self.live_check if reference is not None else ())
        filled = {**values, OUT: streams, RUN: streams.name}
        if reference is not None:
            filled[REFERENCE] = reference
        what = dict(self.recording)
        if from_step is not None:  # a resume bisect records only steps >= K on both sides
            what["steps"] = f"{from_step}:"
        env = with_variables(os.environ, recording_variables(**what)) if what else None
        return Launch(fill_placeholders(argv, filled), env, streams)

    def judge(self, label: str, launch: Launch, code: int, log: Path) -> str | None:
        """By its own exit status (a run its live check stopped is told apart by the caller, by its marker)."""
        if code != 0:
            raise failed(label, launch.argv, code, log)
        return None

    def describe(self, launch: Launch) -> str:
        return f"{self.nproc} rank(s), {self.steps} steps ..."

    def verify_resume_step(self, resume_at: int | None, require_resume: bool) -> int | None:
        return check_verify_steps(self.steps, resume_at)

    def bisect_commands(self, resume_at: int | None) -> tuple[str, str]:
        if not self.bisect_words:
            return "", ""
        return shlex.join(self.bisect_words), shlex.join([*self.bisect_words, "--resume-at", str(resume_at)])

    def notes(self) -> list[str]:
        return []


def work_folder(streams: Path) -> Path:
    """A command's own folder (its ``{out}``) beside the stream folder samebits records it into."""
    return streams.with_name(streams.name + "-work")


@dataclass(frozen=True)
class ZeroCode:
    """A command under zero-code recording: ``argv`` (RECORD, and SAVE: it saves where it saves
    itself) and ``resume`` (RESUME; None: none).  Filled per run, so no two runs share a folder:
    ``{out}`` (its own new work folder), ``{run}``, and in a resumed run (``step_offset`` K)
    ``{step}`` (K) and ``{from}`` (the resumed run's work folder)."""

    argv: tuple[str, ...]
    resume: tuple[str, ...] | None = None
    recording: Mapping[str, object] = field(default_factory=dict)
    variables: Mapping[str, str] = field(default_factory=dict)  # set in its environment (verify --across's layout)
    steps = None
    nproc = None
    census_decides = False

    @property
    def resumes(self) -> bool:
        return self.resume is not None

    def refuse_early(self) -> None:
        if not self.argv:
            raise ConfigError("no command given: write `samebits verify -- python train.py ...`.")
        recording_variables(**self.recording)  # a bad choice is refused before any run starts

    def template(self, role: str) -> tuple[str, ...]:
        """RESUME: its resume command; SAVE_ONLY: none (a command saves where it saves itself)."""
        return tuple(self.resume or ()) if role == RESUME else () if role == SAVE_ONLY else tuple(self.argv)

    def launch(self, role: str, streams: Path, *, work: Path | None = None, values: Mapping[str, object] = {},
               reference: Path | None = None, step_offset: int | None = None,
               from_step: int | None = None) -> Launch:
        work = work if work is not None else work_folder(streams)
        work.mkdir(parents=True, exist_ok=True)
        filled: dict[str, object] = {OUT: work, RUN: streams.name}
        if step_offset is not None:  # {step} and {from} belong to a resumed command only
            filled.update({key: value for key, value in values.items() if key in (STEP, FROM)})
        what = dict(self.recording)
        if from_step is not None:  # a resume bisect compares steps >= K only
            what["steps"] = f"{from_step}:"
        env = environment_for(streams, command=shlex.join(self.argv), reference=reference, step_offset=step_offset,
                              **what)
        env.update(self.variables)
        return Launch(fill_placeholders(self.template(role), filled), env, streams)

    def judge(self, label: str, launch: Launch, code: int, log: Path) -> str | None:
        """`judge_recorded_run`; and a run in which samebits could not start recording at all (a
        ``startup`` gap and no stream) has nothing to compare: `RunFailed` saying what failed."""
        note = judge_recorded_run(label, launch.argv, code, launch.streams, log)
        gaps = [gap for gap in read_gaps(launch.streams) if gap.get("site") == "startup"]
        if gaps and not any(launch.streams.glob("rank-*.sbs")):
            raise RunFailed(f"run {label} ran ({shlex.join(launch.argv)}) but samebits could not record it: "
                            f"{gaps[0].get('error')}. {summarise_gaps(gaps)}.", "samebits could not record", label)
        return note

    def describe(self, launch: Launch) -> str:
        return shlex.join(launch.argv)

    def verify_resume_step(self, resume_at: int | None, require_resume: bool) -> int | None:
        check_resume_options(self.argv, None if self.resume is None else shlex.join(self.resume), resume_at,
                             require_resume)
        return resume_at

    def bisect_commands(self, resume_at: int | None) -> tuple[str, str]:
        prefix = _recording_prefix(self.recording)
        independent = prefix + "samebits bisect -- " + shlex.join(self.argv)  # bisect fills {out}, {run}
        if self.resume is None:
            return independent, ""
        return independent, resume_bisect_command(list(self.argv), list(self.resume), resume_at, self.recording)

    def notes(self) -> list[str]:
        if self.resume is None or holds(self.argv, OUT):
            return []
        return ["the command has no {out}: A and B write their checkpoints to the same place, so C may resume "
                "from B's; put {out} in the command's checkpoint folder and {from} in --resume-with "
                "(docs/resume.md)"]


def resume_bisect_command(cmd: Sequence[str], resume_with: Sequence[str], resume_at: int,
                          record: Mapping | None = None) -> str:
    """The `samebits bisect` command that locates the origin of a resume divergence: A the command,
    B the resume command numbered from ``resume_at``, placeholders left for bisect to fill per
    run as verify does; ``record``: verify's choice of what to record, as the variables bisect reads."""
    return _recording_prefix(record) + shlex.join(["samebits", "bisect", "--a", _join(cmd), "--b", _join(resume_with),
                                                   "--b-step-offset", str(resume_at)])


def _join(argv: Sequence[str]) -> str:
    """`shlex.join` that leaves a placeholder's braces unquoted (the words go inside a quoted
    --a/--b, where no shell expands them)."""
    return " ".join(word if re.fullmatch(r"[\w@%+=:,./{}-]+", word) else shlex.quote(word) for word in argv)


def _recording_prefix(record: Mapping | None) -> str:
    """``VAR=value `` for each ``SAMEBITS_*`` variable of what verify recorded (``--exclude``
    ...), which bisect reads for every run; its step window is bisect's own."""
    chosen = sorted((name, value) for name, value in recording_variables(**(record or {})).items()
                    if value is not None and name != "SAMEBITS_STEPS")
    return "".join(shlex.quote(f"{name}={value}") + " " for name, value in chosen)


__all__ = ["Program", "SelfRecording", "ZeroCode", "Launch", "work_folder", "resume_bisect_command", "RECORD", "SAVE",
           "SAVE_ONLY", "RESUME"]
