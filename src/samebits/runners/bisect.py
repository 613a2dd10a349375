"""`bisect`: narrow a divergence between two runs to its origin, one rung at a time.

Stages, each run on side A and side B, stopping as soon as one can: ``steps`` (rung 1, whole
run: the first divergent step and phase; two different commands are first each run twice, and
a side that is not repeatable is bisected against itself), ``modules`` (rung 2 at that step),
``ops`` (rung 3 in that module's subtree, its parent's for a backward finding) and ``dump``
(the origin's inputs and outputs compared element by element).  A re-run that diverges earlier
than the traced step is traced again from there; one that does not diverge is retried.

The conclusion is proof or "not localised", and never contradicts an earlier stage
(`_bisect_prose.Conclusions._reconcile`); docs/tracing.md ("samebits bisect", "The
conclusion") lists the kinds.  The narrowing is `_bisect_narrow`, the sentences
`_bisect_prose`, the result types `_bisect_result`.  A resume bisect compares step K aligned
on its phases: training phase ``pre`` (A's leftovers of step K-1, B's start-up) is not compared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from samebits import settings
from samebits.errors import ConfigError, SamebitsError
from samebits.runners._bisect_narrow import Side, _Bisector
from samebits.runners._bisect_result import BisectResult, ControlFlow, DifferingElement, Elements, Origin, Stage
from samebits.runners._launch import failed, run_logged
from samebits.runners.commands import (CKPT, STEP, check_bisect_arguments, check_out_dir, default_out_dir,
                                    fill_placeholders, write_summary)
from samebits.runners.program import RESUME, SAVE_ONLY, Program, ZeroCode
from samebits.trace import ENV_VARS


def bisect(cmd_a: list[str] | None = None, cmd_b: list[str] | None = None, *, out=None,
           program: Program | None = None, stop_after: int | None = None,
           run_timeout: float | None = 1800, b_step_offset: int | None = None,
           resume_at: int | None = None, progress: Callable[[str], None] | None = None,
           spec: settings.RecordingSpec | None = None) -> BisectResult:
    """Find where two runs part, and the op that is the origin: ``program`` run twice (with
    ``resume_at`` K, as verify's A and C: one run saves step K under ``out``/ckpt and every B
    resumes it), ``cmd_a`` run twice, or ``cmd_a`` against ``cmd_b`` (each first checked for
    repeatability).

    ``b_step_offset`` K: side B's command resumes at step K (``{step}`` is K, ``{from}`` the work
    folder of A's first run); with it or ``resume_at``, only steps >= K are compared and traced.
    ``{out}`` and ``{run}`` are filled per run as verify fills them (``out``/work/STAGE/SIDE, the
    side's label).  ``spec``: what every command records (default: the ``SAMEBITS_*``
    environment).  ``out`` must be new or empty; a run that crashes raises `SamebitsError`.
    """
    check_bisect_arguments(cmd_a, cmd_b, b_step_offset, resume_at, program.steps if program is not None else None)
    if (program is None) == (not cmd_a):
        raise ConfigError("bisect: give a command (or --a and --b) or the program to run, not both"
                          if program is not None else "bisect: no command given: write `samebits bisect -- python "
                          "train.py ...`, or --a 'CMD' --b 'CMD'.")
    if resume_at is not None and program is not None and not program.template(SAVE_ONLY):
        raise ConfigError("--resume-at bisects a program that can save its checkpoint and exit (the reference "
                          "recipe); for a command give --a, --b and --b-step-offset K.")
    out = check_out_dir(out if out is not None else default_out_dir("bisect"))
    if program is not None:
        program.refuse_early()  # before any run and any folder
    out.mkdir(parents=True, exist_ok=True)
    if program is None:  # commands under zero-code recording; what they record is the same for every run
        recording = {"spec": spec if spec is not None else settings.RecordingSpec.from_env()}
        side_a = Side("a", ZeroCode(tuple(cmd_a), recording=recording), from_step=b_step_offset)
        side_b = Side("b", ZeroCode(tuple(cmd_b or cmd_a), recording=recording), step_offset=b_step_offset,
                      from_step=b_step_offset)
        same = cmd_b is None
    elif resume_at is None:
        side_a, side_b, same = Side("a", program), Side("b", program), True
    else:  # every B resumes one checkpoint of step K, every A runs through; steps >= K compared
        ckpt = _save_checkpoint(program, resume_at, out, run_timeout, progress)
        side_a = Side("a", program, from_step=resume_at)
        side_b = Side("b", program, RESUME, {CKPT: ckpt}, step_offset=resume_at, from_step=resume_at)
        same = False
    bisector = _Bisector(side_a, side_b, out, progress, stop_after, same, run_timeout)
    try:
        result = bisector.bisect()
    except SamebitsError as err:
        _add_earlier_stages(err, bisector.stages)
        raise
    write_summary(out, result)
    return result


def _add_earlier_stages(err: SamebitsError, stages: list[Stage]) -> None:
    """Write what the finished stages found into ``err``'s message (issue 35): the divergence they
    located is often the answer the user came for, and the failed run's error alone hides it."""
    done = [(number, stage) for number, stage in enumerate(stages, 1) if stage.verdict]
    if not done or not err.args:
        return
    stopped = len(stages) if len(stages) > len(done) else None
    lines = [f"bisect stopped{f' in stage {stopped} ({stages[stopped - 1].name})' if stopped else ''} "
             "(its error below); the stages before it found:"]
    for number, stage in done:
        lines.append(f"  stage {number} ({stage.name}, rung {stage.rung}, {stage.scope}): {stage.summary or stage.verdict}")
        if stage.finding is not None and stage.finding.detail:
            lines.append(f"    {stage.finding.detail}")
    err.args = ("\n".join(lines + [str(err.args[0])]), *err.args[1:])


def _save_checkpoint(program: Program, step: int, out: Path, timeout: float | None,
                     progress: Callable[[str], None] | None) -> Path:
    """Run the program to ``step``, untraced and unrecorded, saving the checkpoint every B resumes;
    returns the checkpoint root."""
    ckpt, log = out / "ckpt", out / "logs" / "save.log"
    save = fill_placeholders(program.template(SAVE_ONLY), {STEP: step, CKPT: ckpt})
    (progress or (lambda message: None))(f"[0] save   the checkpoint of step {step} that every run b resumes ...")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    code, _ = run_logged(save, log, env=env, timeout=timeout, label="save")
    if code != 0 or not (ckpt / f"step-{step}").is_dir():
        raise failed("save", save, code, log, why="" if code else f"it saved no checkpoint of step {step} in {ckpt}")
    return ckpt


__all__ = ["bisect", "BisectResult", "Origin", "Elements", "DifferingElement", "Stage", "ControlFlow"]
