"""`samebits run --out DIR -- CMD ...`: record any command's training without editing it."""

from __future__ import annotations

import shlex
import subprocess
import sys

from samebits.autorecord import environment_for
from samebits.errors import SamebitsError


def register(sub) -> None:
    parser = sub.add_parser(
        "run",
        help="run a command with zero-code recording",
        description="Run CMD with fingerprint recording injected into every Python process it starts "
        "(parameters, gradients and optimizer state at each optimizer step; top-level module outputs). "
        "Exit code: CMD's own.",
    )
    parser.add_argument("--out", required=True, help="run directory to record into (must not hold streams)")
    parser.add_argument("--steps", default=None, help="record only steps START:STOP")
    parser.add_argument("--ranks", default=None, help="record only these ranks, e.g. 0,2-3")
    parser.add_argument("--max-tensor-bytes", type=int, default=None, help="no digest for larger tensors")
    parser.add_argument("--reference", default=None, help="check each step live against this run")
    parser.add_argument("cmd", nargs="+", metavar="-- CMD", help="the command to run")
    parser.set_defaults(func=run)


def run_recorded(cmd: list[str], out, **settings) -> int:
    """Run ``cmd`` with recording into ``out``; return its exit code."""
    if not cmd:
        raise SamebitsError("no command given: write `samebits run --out DIR -- python train.py ...`.")
    env = environment_for(out, command=shlex.join(cmd), **settings)
    try:
        return subprocess.call(cmd, env=env)
    except FileNotFoundError:
        raise SamebitsError(f"cannot run {cmd[0]!r}: no such program. Check the command after `--`.") from None


def run(args) -> int:
    code = run_recorded(args.cmd, args.out, steps=args.steps, ranks=args.ranks,
                        max_tensor_bytes=args.max_tensor_bytes, reference=args.reference)
    from samebits.cli.show import summarise

    try:
        summary = summarise(args.out)
    except SamebitsError as err:
        print(f"samebits run: command exited with {code}; nothing was recorded ({err})", file=sys.stderr)
        return code or 2
    steps = max((r["steps"] for r in summary["ranks"]), default=0)
    records = sum(r["records"] for r in summary["ranks"])
    print(f"samebits run: command exited with {code}; recorded {len(summary['ranks'])} rank(s), "
          f"{steps} step(s), {records:,} records into {args.out}", file=sys.stderr)
    return code
