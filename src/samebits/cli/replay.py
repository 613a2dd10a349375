"""`samebits replay RUN --step K --nproc N [--with 'CMD']`: replay a recorded run's step on N ranks."""

from __future__ import annotations

import shlex
import sys

from samebits.cli._format import echo, escape, print_result, table
from samebits.cli._lazy import lazy
from samebits.cli._recipe import replay_command, replay_config_at
from samebits.cli._options import (add_out_option, add_run_timeout_option, check_input_directory, check_out_directory,
                                   positive_int, rank_count, step_number)
from samebits.verdicts import Verdict

DiffResult = lazy("samebits.compare", "DiffResult")
ReplayResult, replay = lazy("samebits.runners.replay", "ReplayResult", "replay")


EXAMPLES = """\
samebits replay runs/dp4 --step 5 --nproc 1    # a grad_reduce=invariant run, on 1 rank
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "replay",
        help="re-execute a recorded run's step K on N ranks and compare (invariant-mode runs)",
        description="From RUN's checkpoint at step K, re-run steps K..K+n-1 on --nproc ranks and compare rank "
        "0's replicated records (parameters, reduced gradients, global metrics) with what RUN recorded. Only "
        "a run trained with grad_reduce=invariant (docs/invariance.md) can be replayed at another data-parallel "
        "size. With no --with command: the reference recipe, with the run's recorded config (at another rank count: "
        "N data-parallel ranks and --allow-layout-change, which the recipe refuses where the run's switches do not "
        "cover the change). A command gets {nproc}, {out}, {step}, {stop}, "
        "{run} and {ckpt} filled in. Exit 0 IDENTICAL, 1 DIVERGED, 2 could not run or decide.",
    )
    parser.add_argument("run_dir", metavar="RUN", help="the recorded run (its stream folder)")
    parser.add_argument("--step", type=step_number, required=True, metavar="K", help="the first step to replay")
    parser.add_argument("--num-steps", type=positive_int, default=1, metavar="N", help="steps to replay (default 1)")
    parser.add_argument("--nproc", type=rank_count, default=1, metavar="N", help="ranks of the replay (default 1)")
    parser.add_argument("--ckpt", default=None, metavar="DIR",
                        help="the checkpoint folder (default RUN/ckpt or RUN/../ckpt)")
    add_out_option(parser, "replay")
    add_run_timeout_option(parser, "kill a replay that takes longer and report a hang")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--with", dest="replay_with", default=None, metavar="'CMD'",
                        help="the training command to replay with (quoted), e.g. 'torchrun --nproc-per-node "
                             "{nproc} train.py --resume-from {ckpt} --start {step} --steps {stop} --out {out}'")
    parser.set_defaults(func=run)


def run(args) -> int:
    def progress(message: str) -> None:
        echo(message, file=sys.stderr, flush=True)

    check_input_directory(args.run_dir)
    check_out_directory(args.out)
    command = shlex.split(args.replay_with) if args.replay_with else None
    # No command of the user's: the reference recipe, with the run's recorded config.
    result = replay(args.run_dir, step=args.step, nproc=args.nproc, num_steps=args.num_steps,
                    cmd=command or replay_command(args.nproc),
                    recorded_config=None if command else replay_config_at(args.nproc),
                    ckpt=args.ckpt, out=args.out, run_timeout=args.run_timeout, progress=progress)
    return print_result(result, args.json, render)


def render(result: ReplayResult) -> str:
    steps = f"step {result.step}" if result.stop == result.step + 1 else f"steps {result.step}..{result.stop - 1}"
    lines = [f"samebits replay: {result.verdict.value.upper()} ({steps} of {escape(result.run)}, recorded on "
             f"{result.recorded_world_size} ranks, replayed on {result.nproc})", ""]
    lines += [check_row_table([("replay", result.check)]), ""]
    lines += [f"note: {escape(note)}" for note in result.notes + result.check.notes]
    lines.append(f"wall time: replay {result.timings.get('replay', 0):.1f} s; records, log and summary.json in "
                 f"{escape(result.out)}")
    return "\n".join(lines)


def check_row_table(checks: list[tuple[str, DiffResult]]) -> str:
    """One row per comparison: verdict, what was compared, the first divergence or why not decided."""
    rows = []
    for label, check in checks:
        c = check.compared
        counts = f"rank {c.get('rank', 0)}: {c['steps']} step(s) x {c['records']:,} records"
        verdict = Verdict(check.verdict)
        if verdict is Verdict.DIVERGED:
            d = check.first_divergence
            rows.append([label, "DIVERGED", counts, f"step {d.step}: {d.phase}/{d.name}"])
        elif verdict is Verdict.IDENTICAL:
            rows.append([label, "IDENTICAL", counts, "-"])
        else:
            rows.append([label, verdict.value.upper(), counts, "; ".join(check.incomplete[:2]) or "-"])
    return table(["comparison", "verdict", "compared", "first divergence"], rows)
