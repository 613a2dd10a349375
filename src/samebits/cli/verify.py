"""`samebits verify [-- CMD ...]`: check both guarantees (independent runs; exact resume)."""

from __future__ import annotations

import sys
import time

from samebits.cli._format import print_json, table
from samebits.verify import VerifyResult, verify_command, verify_recipe


def register(sub) -> None:
    parser = sub.add_parser(
        "verify",
        help="check both guarantees on the reference recipe or any command",
        description="Run A, B (independent) and C (checkpoint at --resume-at, fresh process resumes) and "
        "compare bit for bit. With no command: the built-in reference recipe on 2 ranks. "
        "Exit 0 both hold, 1 either fails, 2 could not run.",
    )
    parser.add_argument("--out", default=None, help="output directory (default: samebits-out/verify-TIME)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (recipe; default 8)")
    parser.add_argument("--resume-at", type=int, default=None, help="checkpoint/resume step (default: steps/2)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (recipe; default 2)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe config override, repeatable")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="use the recipe's nondeterministic path: the verdict must show where it diverges")
    parser.add_argument("--resume-with", default=None, metavar="'CMD {step}'",
                        help="with a command: how to resume it from checkpoint step {step}")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("cmd", nargs="*", metavar="-- CMD", help="a command to check instead of the recipe")
    parser.set_defaults(func=run)


def run(args) -> int:
    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    start = time.perf_counter()
    if args.cmd:
        result = verify_command(args.cmd, args.out, resume_with=args.resume_with, resume_at=args.resume_at,
                                progress=progress)
    else:
        result = verify_recipe(args.out, steps=args.steps, resume_at=args.resume_at, nproc=args.nproc,
                               overrides=args.overrides, nondeterministic=args.nondeterministic,
                               progress=progress)
    result.timings["total"] = time.perf_counter() - start
    if args.json:
        print_json(result.to_json())
    else:
        print(render(result))
    return 0 if result.verdict == "pass" else 1


def render(result: VerifyResult) -> str:
    rows = []
    labels = {"independent": "1. independent runs A = B",
              "resume": f"2. resume at step {result.resume_at}: A = C"}
    for name, check in result.checks.items():
        if check is None:
            rows.append([labels[name], "not run", "-", "(give --resume-with to check resume)"])
            continue
        c = check.compared
        counts = f"{c['ranks']} x {c['steps']} x {c['records']:,}"
        if check.identical:
            rows.append([labels[name], "IDENTICAL", counts, "-"])
        else:
            d = check.first_divergence
            where = f"step {d.step}, rank {d.rank}: " + (f"{d.phase}/{d.name}" if d.name else d.detail)
            rows.append([labels[name], "DIVERGED", counts, where])
    lines = [f"samebits verify: {'PASS' if result.verdict == 'pass' else 'FAIL'}", "",
             table(["guarantee", "verdict", "ranks x steps x records", "first divergence"], rows), ""]
    times = ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items())
    lines.append(f"wall time: {times}")
    lines.append(f"streams, logs and summary.json in {result.out}")
    if result.verdict == "fail":
        lines.append(f"next: `samebits diff {result.out}/a {result.out}/b` for the details, "
                     "or `samebits bisect` to find the origin op")
    return "\n".join(lines)
