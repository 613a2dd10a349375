"""`samebits verify [-- CMD ...]`: check both guarantees (independent runs; exact resume)."""

from __future__ import annotations

import shlex
import time

from samebits.cli._format import print_result, table
from samebits.cli._lazy import lazy
from samebits.cli._options import (MAX_NPROC, add_out_option, add_progress_options, add_recipe_options,
                                   add_recording_options, add_run_timeout_option, check_out_directory, progress_for,
                                   recording_options, step_number)
from samebits.cli._recipe import across_layouts, across_reductions, recipe_program
from samebits.errors import ConfigError
from samebits.recipes.cells import parse_layouts
from samebits.verdicts import Verdict

command_layouts, verify_across = lazy("samebits.runners.across", "command_layouts", "verify_across")
VerifyResult, verify = lazy("samebits.runners.verify", "VerifyResult", "verify")
ZeroCode = lazy("samebits.runners.program", "ZeroCode")
verify_conclusion, across_conclusion = lazy("samebits.runners.conclusion", "verify_conclusion", "across_conclusion")
# torch-free: the library's own argument checks, made before the library is loaded
check_resume_options, check_verify_steps = lazy("samebits.runners.commands", "check_resume_options", "check_verify_steps")


EXAMPLES = """\
samebits verify                                # the reference recipe, both guarantees
samebits verify --resume-at 4 --resume-with 'python train.py --out {out} --resume {from}' -- python train.py --out {out}
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "verify",
        help="check both guarantees on the reference recipe or any command",
        description="Run A and B (independent runs: must be identical) and, for the recipe or with "
        "--resume-with, C (resumes A's checkpoint of step --resume-at in a fresh process: must equal A from "
        "there on), and compare bit for bit. With no command: the built-in reference recipe on 2 ranks. "
        "The verdict names the guarantees it checked. Exit 0 PASS, 1 FAIL, 2 could not run or decide "
        "(a run that raised, a damaged stream, --require-resume without a resume check). "
        "Resume your own script: docs/resume.md.",
    )
    add_out_option(parser, "verify")
    add_progress_options(parser)
    add_recipe_options(parser, steps=8, nproc=2, nondeterministic=True)
    parser.add_argument("--resume-at", type=step_number, default=None, metavar="K",
                        help="the resume step: recipe default steps/2; with a command it is required "
                             "with --resume-with (samebits cannot know where your script checkpoints); with "
                             "--across --resume-across: where the other layouts resume the first's checkpoint")
    parser.add_argument("--resume-with", default=None, metavar="'CMD'",
                        help="with a command: how to resume it from A's checkpoint; {from} is A's work folder "
                             "(the {out} A ran with), {step} the --resume-at step, {out} C's own work folder; with "
                             "--across CELLS --resume-across: how each layout resumes the first one's checkpoint")
    parser.add_argument("--require-resume", action="store_true",
                        help="exit 2 unless the resume guarantee is checked too (for CI)")
    parser.add_argument("--keep-going", action="store_true",
                        help="do not stop B and C at their first step that differs from A (the live check): "
                             "they run to the end, so `samebits report` shows the whole divergent curves")
    add_run_timeout_option(parser, "with a command: kill a run that takes longer and report a hang")
    parser.add_argument("--across", default=None, nargs="+", metavar="LAYOUTS",
                        help="run the recipe at each layout (cells: single,dp2,tp2; or a product of sizes: dp=1,2 "
                             "tp=1,2) with the switches that make its reductions layout-invariant, compare every "
                             "step's parameters by global digest with the first layout, run the negative controls, "
                             "and write certificate.json; a command takes dp=N,N,... (it records itself into {out}) "
                             "or cells such as single,fsdp2 (it reads SAMEBITS_LAYOUT, as samebits' torchtitan "
                             "config does; {nproc} and {out} filled in; docs/invariance.md)")
    parser.add_argument("--resume-across", action="store_true",
                        help="with --across: the first layout also saves its checkpoint of step --resume-at (default "
                             "steps/2), every other layout resumes it (--allow-layout-change) and must equal the "
                             "first layout's run bit for bit from there to the end")
    parser.add_argument("--no-controls", action="store_true",
                        help="with --across: skip the negative controls (the layouts without the switches, which "
                             "must differ); the certificate says they were not run")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    add_recording_options(parser)
    parser.add_argument("cmd", nargs="*", metavar="-- CMD",
                        help="a command to check instead of the recipe; {out} and {run} are filled in per run")
    parser.set_defaults(func=run)


def run(args) -> int:
    check(args)
    progress = progress_for(args)  # stderr, each line after the elapsed time; each run's steps live

    start = time.perf_counter()
    if args.across is not None:
        return run_across(args, progress, start)
    if args.cmd:
        program = ZeroCode(tuple(args.cmd), None if args.resume_with is None else tuple(shlex.split(args.resume_with)),
                           recording=recording_options(args))
    else:
        program = recipe_program(args.nproc, steps=args.steps, overrides=args.overrides,
                                 nondeterministic=args.nondeterministic, recording=recording_options(args))
    result = verify(program, args.out, resume_at=args.resume_at, require_resume=args.require_resume,
                    run_timeout=args.run_timeout, progress=progress, keep_going=args.keep_going)
    result.timings["total"] = time.perf_counter() - start
    return print_result(result, args.json, render)


def check(args) -> None:
    """Refuse, before the library (and torch) is loaded, options that cannot go together and an
    output folder that is in use, with the library's own checks (`samebits.runners.commands`), so
    that a mistake costs no second of start-up."""
    if args.resume_across and args.across is None:
        raise ConfigError("--resume-across needs --across LAYOUTS (the layouts that resume the first one's "
                          "checkpoint); to check a resume at one layout, drop it (verify checks resume itself)")
    if args.across is not None and args.resume_with is not None and not args.resume_across:
        raise ConfigError("--resume-with with --across is how the other layouts resume the first one's checkpoint: "
                          "add --resume-across --resume-at K, or drop --resume-with")
    if args.across is not None and args.keep_going:
        raise ConfigError("--keep-going applies to the A, B, C runs of verify; --across runs each size once "
                          "with no live check, so drop --keep-going there.")
    if args.across is None and args.cmd:
        check_resume_options(args.cmd, args.resume_with, args.resume_at, args.require_resume)
    elif args.across is not None and not args.cmd:  # the recipe at several layouts, parsed as run_across will
        spec = " ".join(args.across)
        largest = max(parse_layouts(spec), key=lambda dims: dims.world_size)
        if largest.world_size > MAX_NPROC:
            raise ConfigError(f"--across {spec}: {largest.name} needs {largest.world_size} ranks; a run is at most "
                              f"{MAX_NPROC} ranks on this machine")
    elif args.across is None:  # the recipe
        if args.resume_with is not None:
            raise ConfigError("--resume-with needs a command of yours (after --): the reference recipe resumes "
                              "itself; drop --resume-with, or give the command it resumes.")
        check_verify_steps(args.steps, args.resume_at)
    check_out_directory(args.out)


def run_across(args, progress, start: float) -> int:
    """`--across LAYOUTS`: one run per layout, each compared with the first, and the controls."""
    spec = " ".join(args.across)
    if args.cmd:
        layouts = command_layouts(spec, args.cmd, resume=None if args.resume_with is None else
                                  shlex.split(args.resume_with), recording=recording_options(args))
        largest = max(layouts, key=lambda layout: layout.nproc)
        if largest.nproc > MAX_NPROC:
            raise ConfigError(f"--across {spec}: {largest.name} needs {largest.nproc} ranks; a run is at most "
                              f"{MAX_NPROC} ranks on this machine")
        reductions = ()
    else:
        layouts = across_layouts(spec, steps=args.steps, overrides=args.overrides, controls=not args.no_controls)
        reductions = across_reductions(spec)
    across = verify_across(layouts, args.out, run_timeout=args.run_timeout, progress=progress,
                           controls=not args.no_controls, reductions=reductions, resume_across=args.resume_across,
                           resume_at=args.resume_at)
    across.timings["total"] = time.perf_counter() - start
    return print_result(across, args.json, render_across)


def render_across(across) -> str:
    reference = across.layouts[0]
    lines = [f"samebits verify --across: {across.verdict.value.upper()} (each layout against {reference})",
             across_conclusion(across), ""]
    rows = []
    for check in across.checks.values():
        rows.append([f"{reference} = {check.layout}", Verdict(check.verdict).value.upper(), check.by,
                     f"{check.compared.get('steps', 0)} steps", check.where()])
    lines += [table(["layouts", "verdict", "compared by", "window", "first divergence"], rows)]
    lines += ["records: " + "; ".join(f"{check.layout} {check.counts.get('compared', 0)} compared by digest, "
                                      f"{check.counts.get('shape_only', 0)} by shape only, "
                                      f"{check.counts.get('missing', 0)} missing"
                                      for check in across.checks.values()), ""]
    if across.resume is not None:
        rows = []
        for check in across.resume.values():
            rows.append([f"{reference} step {across.resume_at} -> {check.layout}", Verdict(check.verdict).value.upper(),
                         f"{check.compared.get('steps', 0)} steps", check.where()])
        lines += [table(["resumed at another layout", "verdict", "window", "first divergence"], rows), ""]
    if across.checkpoints:
        equal = {True: "all equal", False: "DIFFER", None: "not compared"}[across.checkpoints_equal]
        lines.append(f"final checkpoints by content ({equal}): " + ", ".join(
            f"{name} {(c.get('content_sha256') or 'none')[:16]}" for name, c in across.checkpoints.items()))
    if across.controls is not None:
        lines.append(table(["control (no switches)", "differs", "first step", "detail"],
                           [[c.run, "yes" if c.differs else "NO", "-" if c.first_step is None else str(c.first_step),
                             c.detail] for c in across.controls]))
        lines.append("")
    else:
        lines.append(f"controls: {across.controls_note}")
    lines += [f"note: {note}" for check in across.checks.values() for note in check.notes[:1]]
    lines += [f"note: {note}" for note in across.notes]
    lines.append("wall time: " + ", ".join(f"{k} {v:.1f} s" for k, v in across.timings.items()))
    lines.append(f"streams, logs, summary.json and certificate.json in {across.out} (samebits report {across.out})")
    return "\n".join(lines)


_LABELS = {"independent": "1. independent runs: A = B", "resume": "2. resume: A = C"}


def render(result: VerifyResult) -> str:
    rows = []
    for name, check in result.checks.items():
        label = _LABELS[name] if name != "resume" or result.resume_at is None else \
            f"2. resume at step {result.resume_at}: A = C"
        if check is None:
            rows.append([label, "NOT CHECKED", "-", "give --resume-with 'CMD' and --resume-at K (docs/resume.md)"])
            continue
        c = check.compared
        counts = f"{c['ranks']} x {c['steps']} x {c['records']:,}"
        verdict = result.check_verdict(name)
        if name in result.gaps and verdict is Verdict.INCOMPLETE:
            gap = result.gaps[name]
            rows.append([label, "INCOMPLETE", counts, "samebits could not record " +
                         ("the state census" if gap is None else "this run" if gap < 0 else f"from step {gap}")
                         + " (see the note)"])
        elif verdict is Verdict.IDENTICAL:
            rows.append([label, "IDENTICAL", counts, "-"])
        elif verdict is Verdict.DIVERGED:
            d = check.first_divergence
            where = f"step {d.step}, rank {d.rank}: " + (f"{d.phase}/{d.name}" if d.name else d.detail)
            rows.append([label, "DIVERGED", counts, where])
        else:
            why = list(getattr(check, "incomplete", []) or [])[:1] or check.notes[:2]
            rows.append([label, verdict.value.upper(), counts, "; ".join(why) or "-"])
    checked = " and ".join(result.checked) or "nothing"
    headline = f"samebits verify: {result.verdict.value.upper()} (checked: {checked}"
    headline += f"; not checked: {', '.join(result.not_checked)})" if result.not_checked else ")"
    lines = [headline, verify_conclusion(result), "",
             table(["guarantee", "verdict", "ranks x steps x records", "first divergence"], rows), ""]
    if result.runs:
        lines += [table(["run", "exit", "ended"], [[r.name, str(r.exit_code), r.ended] for r in result.runs]), ""]
    for check, explanations in result.explanations.items():
        lines += [f"{check}: what differs (most specific first):"] + [f"  {line}" for line in explanations]
    lines += [f"note: {note}" for note in result.notes]
    times = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    lines.append(f"wall time: {times}")
    lines.append(f"streams, logs and summary.json in {result.out}")
    lines += next_steps(result)
    return "\n".join(lines)


def next_steps(result: VerifyResult) -> list[str]:
    """Hints that point at the failing comparison, never at one that held."""
    out = result.out
    hints = []
    independent, resume = result.checks.get("independent"), result.checks.get("resume")
    if independent is not None and Verdict(independent.verdict) is Verdict.DIVERGED:
        hints.append(f"next: `samebits diff {out}/a {out}/b` for the details; to find the origin op: "
                     f"`{result.bisect_command}`")
    if resume is not None and Verdict(resume.verdict) is Verdict.DIVERGED:
        step = resume.first_divergence.step
        hints.append(f"next: `samebits diff {out}/a {out}/c --from-step {result.resume_at}` shows A against the "
                     f"resumed run C (first difference at step {step})")
        if independent is not None and independent.identical:
            hints.append("      A = B held, so the difference comes from what the checkpoint saves and restores")
        if result.resume_bisect_command:
            hints.append(f"      to find the origin op of the resume (A against C from step {result.resume_at}): "
                         f"`{result.resume_bisect_command}`")
            hints.append("      (bisect fills {out}, {from} and {step} for every run it makes: each its own new "
                         "folder, its B resuming from its first A's checkpoint)")
    if resume is None:
        hints.append("resume was not checked: add --resume-with 'CMD' --resume-at K (docs/resume.md), "
                     "and --require-resume in CI")
    return hints
