"""`bisect`: narrow a divergence between two runs to its origin, one rung at a time.

Stages (each runs side A and side B, in this order, and stops as soon as it can):

1. ``steps``    rung 1 (phases, collectives, gradients, optimizer state, the model's inputs,
   the state census at each step start) for the whole run: the first divergent step and
   phase.  Identical runs stop here.  With two different commands, each is first run twice
   to separate run-to-run noise from the intended change; a side that is not repeatable is
   bisected against itself.
2. ``modules``  rung 2 for that step, stopping after it: the first divergent module.
3. ``ops``      rung 3 inside that module's subtree (its parent's for a backward finding,
   since a module's input gradient is the total of its consumers'), with call sites.
4. ``dump``     the same run with the origin's inputs and outputs saved, compared element
   by element (how many differ, where, by how many ulps, and whether the two outputs hold
   the same values in another order).

Stages 2 and 3 re-run a step: when the re-run diverges *earlier* than the traced step (a
nondeterminism that fires at a random step), they trace again from the earliest divergent
step seen; when it does not diverge at all, they try again, a bounded number of times.

The conclusion is proof or "not localised": a model input that already differs is the data
pipeline; an RNG op whose inputs matched, with a generator whose state differed at the step
start, is that generator; the same values in another order (an op's list argument, its two
outputs, or whole records such as the optimizer's parameters) are an ordering problem, named;
"below the dispatcher" needs a module whose inputs matched and whose output differs with no
ATen op inside it to blame.  Anything else is reported as not localised, with what was ruled
out.  A conclusion never contradicts an earlier stage: once a stage found "phase P: inputs
matched, output differs", the final kind is about P, about the state the step started from,
or not localised (`_bisect_prose.Conclusions._reconcile`).

The narrowing is `_bisect_narrow` (its stages and re-runs), the sentences `_bisect_prose`, the
result types `_bisect_result`; each run is a `samebits.runs.program.Program` in a role.

A resume bisect (side B resumes A's checkpoint at step K) compares step K aligned on its
phases: the work before the step's first forward/backward/optimizer step (training phase
``pre``: A's leftovers of step K-1, B's start-up) is not compared there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from samebits import settings
from samebits.errors import ConfigError, SamebitsError
from samebits.runs._bisect_narrow import Side, _Bisector
from samebits.runs._bisect_result import BisectResult, ControlFlow, DifferingElement, Elements, Origin, Stage
from samebits.runs._launch import failed, run_logged
from samebits.runs.commands import (CKPT, STEP, check_bisect_arguments, check_out_dir, default_out_dir,
                                    fill_placeholders, write_summary)
from samebits.runs.program import RESUME, SAVE_ONLY, Program, ZeroCode
from samebits.trace import ENV_VARS


def bisect(cmd_a: list[str] | None = None, cmd_b: list[str] | None = None, *, out=None,
           program: Program | None = None, stop_after: int | None = None,
           run_timeout: float | None = 1800, b_step_offset: int | None = None,
           resume_at: int | None = None, progress: Callable[[str], None] | None = None,
           spec: settings.RecordingSpec | None = None) -> BisectResult:
    """Find where two runs part, and the op that is the origin.

    * ``program``: a program (`samebits.runs.program`; the reference recipe, as in ``samebits
      verify``: `samebits.recipes.commands`), run twice; with ``resume_at`` K, its resume, as
      `samebits verify`'s runs A and C: one run saves the checkpoint of step K (under
      ``out``/ckpt), every B resumes it, every A runs through; only steps >= K are compared
      and traced;
    * ``cmd_a`` only: that command twice (its run-to-run nondeterminism);
    * ``cmd_a`` and ``cmd_b``: each checked for repeatability, then A against B.

    ``stop_after``: end every run after that step (a long command).  ``run_timeout``: seconds
    one run may take before it is killed (with every process it started) and reported as a
    hang.  ``b_step_offset``: side B resumes at step K (its steps are numbered from K, as
    ``samebits verify --resume-at K`` numbers run C); both sides record, and every stage
    compares and traces, only steps >= K, so A's steps before the resume are no divergence.
    ``{out}`` and ``{run}`` in a command are filled per run, as `samebits verify` fills them:
    a work folder of its own, new and empty (``out``/work/STAGE/SIDE), and the side's label; in
    B's command with ``b_step_offset`` K, ``{step}`` is K and ``{from}`` the work folder of the
    bisect's first run of A (where it saved the checkpoints every B resumes).  ``spec``: what
    every run records (default: the environment's ``SAMEBITS_*`` choice, e.g. SAMEBITS_EXCLUDE).
    Output (streams, logs, dumps) goes under ``out``, which must be new or empty.
    A run that crashes raises `SamebitsError` (the CLI exits 2): never a verdict.
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
    """A bisect that cannot go on (a run failed, exit 2) keeps what its finished stages found
    (issue 35): the first divergence they located is often the answer the user came for, and
    an error that shows only the failed run hides it.  Written into ``err``'s message (its
    type and attributes kept); nothing when no stage finished."""
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
    """Run the program once up to ``step`` and save its checkpoint there (`samebits verify`'s
    run C before its resume), untraced and unrecorded: every B of the bisect resumes from it,
    while every A runs through from step 0.  Returns the checkpoint root."""
    ckpt, log = out / "ckpt", out / "logs" / "save.log"
    save = fill_placeholders(program.template(SAVE_ONLY), {STEP: step, CKPT: ckpt})
    (progress or (lambda message: None))(f"[0] save   the checkpoint of step {step} that every run b resumes ...")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    code, _ = run_logged(save, log, env=env, timeout=timeout, label="save")
    if code != 0 or not (ckpt / f"step-{step}").is_dir():
        raise failed("save", save, code, log, why="" if code else f"it saved no checkpoint of step {step} in {ckpt}")
    return ckpt


__all__ = ["bisect", "BisectResult", "Origin", "Elements", "DifferingElement", "Stage", "ControlFlow"]
