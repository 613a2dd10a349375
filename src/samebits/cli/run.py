"""`samebits run --out DIR -- CMD ...`: record any command's training without editing it."""

from __future__ import annotations

import sys

from samebits.cli._format import echo
from samebits.cli._lazy import lazy
from samebits.cli._options import (add_progress_options, add_recording_options, check_input_directory,
                                   check_out_directory, progress_for, recording_options, step_number)
from samebits.errors import SamebitsError
from samebits.verdicts import EXIT_CANNOT_RUN, EXIT_STOPPED

read_gaps, read_outcomes, read_stop, summarise_gaps = lazy("samebits.autorecord", "read_gaps", "read_outcomes",
                                                          "read_stop", "summarise_gaps")
diff = lazy("samebits.compare", "diff")
run_recorded = lazy("samebits.runners.record", "run_recorded")
summarise = lazy("samebits.stream", "summarise")


EXAMPLES = """\
samebits run --out runs/a -- python train.py
samebits run --out runs/b --reference runs/a -- python train.py   # stop at the first step that differs
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "run",
        help="run a command with zero-code recording",
        description="Run CMD with fingerprint recording injected into every Python process it starts "
        "(parameters, gradients and optimizer state at each optimizer step; top-level module outputs; "
        "the state census at each step start, in DIR/state). Exit code: CMD's own; with --reference, 3 "
        "when the live check stopped the run at a step that differs (docs/cli.md).",
    )
    parser.add_argument("--out", required=True, help="run directory to record into (new, or an empty directory)")
    parser.add_argument("--reference", default=None, metavar="RUN",
                        help="check each step live against this earlier run: at the first step that differs, "
                             "print it and stop the command (exit code 3)")
    parser.add_argument("--step-offset", type=step_number, default=None, metavar="K",
                        help="number the first step K (a resumed run, so its steps line up with the run it "
                             "resumes; default 0)")
    add_recording_options(parser)
    add_progress_options(parser)
    parser.add_argument("cmd", nargs="+", metavar="-- CMD", help="the command to run")
    parser.set_defaults(func=run)


def run(args) -> int:
    check_out_directory(args.out)  # before the library (and torch) is loaded
    if args.reference is not None:
        check_input_directory(args.reference)
    code = run_recorded(args.cmd, args.out, reference=args.reference, step_offset=args.step_offset,
                        progress=progress_for(args), **recording_options(args))
    say = lambda message: echo(f"samebits run: {message}", file=sys.stderr)  # noqa: E731
    gaps = read_gaps(args.out)
    try:
        summary = summarise(args.out)
    except SamebitsError as err:
        say(f"command exited with {code}; nothing was recorded ({err})")
        if gaps:
            say(summarise_gaps(gaps))
        return code or EXIT_CANNOT_RUN
    if gaps:  # the command's own exit code stands: samebits' failure is not the program's
        say(summarise_gaps(gaps) + "; a comparison of this run is INCOMPLETE where it is missing")
    steps = max((r["steps"] for r in summary["ranks"]), default=0)
    records = sum(r["records"] for r in summary["ranks"])
    say(f"command exited with {code}; recorded {len(summary['ranks'])} rank(s), {steps} step(s), "
        f"{records:,} records into {args.out}")
    for outcome in read_outcomes(args.out):
        if outcome.get("ended") == "exception":
            say(f"rank {outcome.get('rank')} raised {outcome.get('exception')} at step {outcome.get('step')}: "
                "its records stop there")
    stop = read_stop(args.out)
    if stop is not None:
        step = stop.get("stopped_at")
        say(f"STOPPED at step {step} (rank {stop.get('rank')}): it differs from the reference {args.reference}")
        try:
            first = diff(args.reference, args.out, stop_step=int(step) + 1, allow_config_diff=True).first_divergence
        except SamebitsError as err:
            first, why = None, str(err)
        else:
            why = "no record differs" if first is None else ""
        if first is not None:
            where = f"{first.phase}/{first.name}" if first.name else first.detail
            say(f"first divergence: step {first.step}, rank {first.rank}: {where}")
        else:
            say(f"(the first differing record could not be named: {why})")
        say(f"details: samebits diff {args.reference} {args.out} --to-step {int(step) + 1}")
        return EXIT_STOPPED  # as its processes do, whatever a launcher (torchrun) made of their code
    return code
