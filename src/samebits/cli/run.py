"""`samebits run --out DIR -- CMD ...`: record any command's training without editing it."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from samebits.autorecord import environment_for, read_outcomes, read_stop
from samebits.cli._format import echo
from samebits.cli.show import summarise
from samebits.compare import diff
from samebits.errors import ConfigError, SamebitsError
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN


def register(sub) -> None:
    parser = sub.add_parser(
        "run",
        help="run a command with zero-code recording",
        description="Run CMD with fingerprint recording injected into every Python process it starts "
        "(parameters, gradients and optimizer state at each optimizer step; top-level module outputs; "
        "the state census at each step start, in DIR/state). Exit code: CMD's own; with --reference, 1 "
        "when the live check stopped the run at a step that differs.",
    )
    parser.add_argument("--out", required=True, help="run directory to record into (new, or an empty directory)")
    parser.add_argument("--steps", default=None, help="record only steps START:STOP")
    parser.add_argument("--ranks", default=None, help="record only these ranks, e.g. 0,2-3")
    parser.add_argument("--max-tensor-bytes", type=int, default=None, help="no digest for larger tensors")
    parser.add_argument("--reference", default=None, metavar="RUN",
                        help="check each step live against this earlier run: at the first step that differs, "
                             "print it and stop the command (its processes exit with code 3)")
    parser.add_argument("--step-offset", type=int, default=None, metavar="K",
                        help="number the first step K (a resumed run, so its steps line up with the run it "
                             "resumes; default 0)")
    parser.add_argument("cmd", nargs="+", metavar="-- CMD", help="the command to run")
    parser.set_defaults(func=run)


def check_out_dir(out) -> Path:
    """Refuse, before anything starts, a --out that is a file or already holds anything."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: give a new directory to record into.")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty (it may hold an earlier run's streams): samebits never "
                          "records over a run. Give a new directory or delete the old one.")
    return out


def run_recorded(cmd: list[str], out, **settings) -> int:
    """Run ``cmd`` with recording into ``out`` (new or empty); return its exit code."""
    if not cmd:
        raise ConfigError("no command given: write `samebits run --out DIR -- python train.py ...`.")
    if settings.get("step_offset") is not None and settings["step_offset"] < 0:
        raise ConfigError(f"--step-offset {settings['step_offset']}: must be >= 0.")
    check_out_dir(out)
    env = environment_for(out, command=shlex.join(cmd), **settings)
    try:
        return subprocess.call(cmd, env=env)
    except FileNotFoundError:
        raise SamebitsError(f"cannot run {cmd[0]!r}: no such program. Check the command after `--`.") from None


def run(args) -> int:
    code = run_recorded(args.cmd, args.out, steps=args.steps, ranks=args.ranks,
                        max_tensor_bytes=args.max_tensor_bytes, reference=args.reference,
                        step_offset=args.step_offset)
    say = lambda message: echo(f"samebits run: {message}", file=sys.stderr)  # noqa: E731
    try:
        summary = summarise(args.out)
    except SamebitsError as err:
        say(f"command exited with {code}; nothing was recorded ({err})")
        return code or EXIT_CANNOT_RUN
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
        return EXIT_BAD_VERDICT
    return code
