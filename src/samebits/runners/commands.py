"""Command templates and output folders: what every runner of `samebits.runners` shares.

A runner fills a command's placeholders per run, so the library never spells a program's own
command line:

    {out}        the folder a run records into (a self-recording program), or its work folder
    {run}        the run's name (a, b, c, dp2, ...)
    {step}       where a run saves its checkpoint, or where a resumed run starts
    {from}       the work folder of the run a resumed command resumes (verify's A)
    {ckpt}       a checkpoint root
    {reference}  a recorded run to check each step against, live
    {nproc}      the number of ranks of one run

The argument checks the command line makes before it loads torch live here, so both share one
definition.  Every runner writes into a new or empty folder and leaves summary.json there.
"""

from __future__ import annotations

import json
import re
import shlex
import time
from pathlib import Path
from typing import Mapping, Sequence

from samebits.errors import ConfigError

OUT, RUN, STEP, FROM, CKPT, REFERENCE, NPROC = "{out}", "{run}", "{step}", "{from}", "{ckpt}", "{reference}", "{nproc}"
PLACEHOLDERS = (OUT, RUN, STEP, FROM, CKPT, REFERENCE, NPROC)
# A command's layout cells for `verify --across` (a program that reads SAMEBITS_LAYOUT, such as
# samebits' torchtitan config, sets its degrees from them; SAMEBITS_INVARIANT=0 is its control).
LAYOUT_VARIABLE, INVARIANT_VARIABLE = "SAMEBITS_LAYOUT", "SAMEBITS_INVARIANT"
CELL_AXES = ("fsdp", "dp", "tp", "pp", "cp")  # FSDP2 shards, replicas, tensor, pipeline, context parallel
_CELL_PART = re.compile(r"(fsdp|dp|tp|pp|cp)([1-9][0-9]*)")


def cell_degrees(cell: str) -> dict[str, int]:
    """``single`` or parts ``fsdpN``, ``dpN``, ``tpN``, ``ppN``, ``cpN`` joined by ``-`` -> the degree
    of every axis of `CELL_AXES` (1 where the cell names none)."""
    degrees = dict.fromkeys(CELL_AXES, 1)
    for part in [] if cell == "single" else cell.split("-"):
        match = _CELL_PART.fullmatch(part)
        if match is None:
            raise ConfigError(f"layout {cell!r}: {part!r} is not one of single, fsdpN, dpN, tpN, ppN, cpN "
                              "(parts joined by -, e.g. fsdp2-tp2)")
        degrees[match.group(1)] = int(match.group(2))
    return degrees


CHECK_TIMEOUT_S = 300.0  # a program's own option check trains nothing: minutes mean something hangs


class RecipeRefused(ConfigError):
    """The program refused its options or config (``said``: its own message) before any run."""

    def __init__(self, said: str):
        super().__init__(f"the recipe refuses these options, before any run: {said}")
        self.said = said


def check_verify_steps(steps: int, resume_at: int | None) -> int:
    """verify's resume step for a program of ``steps`` steps (default ``steps // 2``), refused
    unless inside the run: verify needs a step before and one after the resume."""
    if steps < 2:
        raise ConfigError(f"--steps {steps}: verify needs at least 2 steps (one before and one after the resume).")
    resume_at = steps // 2 if resume_at is None else resume_at
    if not 0 < resume_at < steps:
        raise ConfigError(f"--resume-at {resume_at} must be between 1 and {steps - 1} (inside the run).")
    return resume_at


def check_resume_options(cmd: Sequence[str], resume_with: str | None, resume_at: int | None,
                         require_resume: bool) -> None:
    """Refuse verify's resume options of a command (``resume_with``: how it resumes A's
    checkpoint of step ``resume_at``) that cannot go together."""
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
    for placeholder in (STEP, FROM):
        if holds(cmd, placeholder):
            raise ConfigError(f"the command holds {placeholder}, which only --resume-with can use; use {{out}} "
                              "for the run's own work folder.")


def check_bisect_arguments(cmd_a: Sequence[str] | None, cmd_b: Sequence[str] | None, b_step_offset: int | None,
                           resume_at: int | None, steps: int | None) -> None:
    """Refuse arguments of `samebits bisect` that cannot go together (``steps``: the program's,
    None for a command), before any run and any folder."""
    if cmd_b is not None and not cmd_a:
        raise ConfigError("--b needs --a: give both commands to compare, or one command after --.")
    if b_step_offset is not None:
        if not cmd_a or cmd_b is None:
            raise ConfigError("--b-step-offset needs --a and --b: the run to resume from (A) and the command "
                              "that resumes it at that step (B); for the reference recipe's resume, --resume-at K.")
        if b_step_offset < 0:
            raise ConfigError(f"--b-step-offset {b_step_offset}: a step number cannot be negative; give the "
                              "step the resumed command B starts from (as in --resume-at K).")
    if resume_at is not None:
        if cmd_a:
            raise ConfigError("--resume-at bisects the reference recipe's resume; for your own commands give "
                              "--a (the run that saves), --b (the command that resumes) and --b-step-offset K.")
        if steps is not None and not 0 < resume_at < steps:
            raise ConfigError(f"--resume-at {resume_at} must be between 1 and {steps - 1} (inside the run of "
                              f"--steps {steps}).")
    for words, side in ((cmd_a or [], "--a"), (cmd_b or [], "--b")):
        for placeholder in (STEP, FROM):
            if holds(words, placeholder) and (side == "--a" or b_step_offset is None):
                raise ConfigError(f"{side} holds {placeholder}, which only a resumed command B can use (with "
                                  f"--b-step-offset K: {STEP} is K, {FROM} the work folder of the bisect's "
                                  "first run of A); use {out} for a run's own work folder.")


DETERMINISTIC = "{deterministic}"  # in `samebits tax`'s one command: 1 for the deterministic run, 0 for the baseline


def tax_commands(command: Sequence[str] | None, command_a: str | None,
                 command_b: str | None) -> dict[str, list[str]] | None:
    """`samebits tax`'s commands of the user's, as argv by label ("deterministic", "baseline"):
    ``command`` with `DETERMINISTIC` expanded to 1 and 0, or ``command_a`` and ``command_b``
    (shell words); None when none is given (the reference recipe).  Mistakes are refused."""
    if command and (command_a is not None or command_b is not None):
        raise ConfigError("give either `-- CMD` (with {deterministic}) or --a 'CMD' --b 'CMD', not both.")
    if (command_a is None) != (command_b is None):
        raise ConfigError("--a and --b go together: --a is the deterministic command, --b the baseline.")
    if command:
        if not holds(command, DETERMINISTIC):
            raise ConfigError(f"the command has no {DETERMINISTIC}: samebits cannot switch your script's "
                              "deterministic mode. Put {deterministic} where it takes the switch (it becomes 1 for "
                              "the deterministic run and 0 for the baseline), or give two commands with --a and --b.")
        return {label: [part.replace(DETERMINISTIC, switch) for part in command]
                for label, switch in (("deterministic", "1"), ("baseline", "0"))}
    if command_a is not None:
        return {"deterministic": shlex.split(command_a), "baseline": shlex.split(command_b)}
    return None


def fill_placeholders(argv: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """``argv`` with each placeholder (a key of ``values``, e.g. ``"{out}"``) replaced by its
    value, inside words too (``--out={out}/a``)."""
    filled = []
    for part in argv:
        for placeholder, value in values.items():
            part = part.replace(placeholder, str(value))
        filled.append(part)
    return filled


def holds(argv: Sequence[str], placeholder: str) -> bool:
    """Whether a word of ``argv`` holds ``placeholder``."""
    return any(placeholder in part for part in argv)


def default_out_dir(kind: str) -> Path:
    """samebits-out/KIND-YYYYMMDD-HHMMSS: where a runner writes when given no folder."""
    return Path("samebits-out") / time.strftime(f"{kind}-%Y%m%d-%H%M%S")


def check_out_dir(out) -> Path:
    """Refuse, before anything starts, an ``out`` that is a file or holds anything: samebits
    never writes over runs."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: give a new directory to write into.")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not an empty directory (it may hold an earlier run): samebits "
                          "never overwrites runs. Pass a new --out directory or delete the old one.")
    return out


def prepare_out_dir(out, kind: str) -> Path:
    """The output folder of a runner (``out``, or `default_out_dir` of ``kind``), checked to be
    new or empty, created with its logs/ folder."""
    out = check_out_dir(out if out is not None else default_out_dir(kind))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return out


def write_summary(out: Path, result, name: str = "summary.json") -> Path:
    """``result.to_dict()`` as indented JSON in ``out``/``name``; returns the file."""
    path = Path(out) / name
    path.write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return path


__all__ = ["RecipeRefused", "check_verify_steps", "check_resume_options", "check_bisect_arguments", "tax_commands", "fill_placeholders", "holds", "default_out_dir", "check_out_dir",
           "prepare_out_dir", "write_summary", "PLACEHOLDERS", "OUT", "RUN", "STEP", "FROM", "CKPT", "REFERENCE",
           "NPROC", "cell_degrees", "CELL_AXES", "LAYOUT_VARIABLE", "INVARIANT_VARIABLE"]
