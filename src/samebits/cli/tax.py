"""`samebits tax [-- CMD] [--gate 1.05]`: the determinism tax as a ratio with a confidence interval."""

from __future__ import annotations

import math

from samebits.cli._format import print_result, table
from samebits.cli._options import (add_out_option, add_progress_options, add_recipe_options, add_run_timeout_option,
                                   int_range, open_unit_interval, positive_int, progress_for, step_number)
from samebits.cli._lazy import lazy
from samebits.cli._recipe import tax_programs
from samebits.defaults import DEFAULT_GATE
from samebits.errors import ConfigError

TaxResult, tax = lazy("samebits.runs.tax", "TaxResult", "tax")


MAX_RESAMPLES = 10**6  # the bootstrap holds resamples x pairs x steps indices in memory


def register(sub) -> None:
    parser = sub.add_parser(
        "tax",
        help="measure how much slower deterministic mode is (paired runs, bootstrap interval, gate)",
        description="Run the deterministic command and the baseline in interleaved pairs, take the step times "
                    "from the recorded streams, and report the ratio of the median step times with a paired "
                    "bootstrap interval. With no command: the reference recipe with deterministic=true/false. With -- CMD: "
                    "{deterministic} in the command becomes 1, then 0. With --a/--b: two commands. Exit 0 when "
                    "the interval is at most --gate, 1 when it is wholly over, 2 when it spans the gate (inconclusive: "
                    "add pairs) or a run failed. "
                    "Protocol: docs/tax.md.",
    )
    parser.add_argument("--gate", type=float, default=DEFAULT_GATE,
                        help=f"pass when the interval's upper bound is at most this ratio, fail when its lower bound is over "
                             f"it (default {DEFAULT_GATE})")
    parser.add_argument("--pairs", type=positive_int, default=5, help="paired runs (default 5)")
    parser.add_argument("--warmup", type=step_number, default=2, help="timed steps dropped at the start of each run (default 2)")
    add_recipe_options(parser, steps=12, nproc=1)
    parser.add_argument("--a", dest="cmd_a", default=None, metavar="'CMD'", help="the deterministic command, quoted")
    parser.add_argument("--b", dest="cmd_b", default=None, metavar="'CMD'", help="the baseline command, quoted")
    parser.add_argument("--confidence", type=open_unit_interval, default=0.95,
                        help="interval coverage, between 0 and 1 (default 0.95)")
    parser.add_argument("--resamples", type=int_range(100, MAX_RESAMPLES, 4000), default=4000,
                        help=f"bootstrap resamples, 100 to {MAX_RESAMPLES:,} (default 4000)")
    parser.add_argument("--seed", type=int_range(0, 2**64 - 1, 0), default=0, help="bootstrap seed (default 0)")
    add_run_timeout_option(parser)
    add_out_option(parser, "tax")
    add_progress_options(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("cmd", nargs="*", metavar="-- CMD", help="a command holding {deterministic}")
    parser.set_defaults(func=run)


def run(args) -> int:
    if not math.isfinite(args.gate):  # the library refuses a gate <= 0; nan or inf would decide nothing
        raise ConfigError(f"--gate {args.gate}: a ratio gate is a positive finite number, e.g. 1.05.")
    recipe = not (args.cmd or args.cmd_a or args.cmd_b)  # no command of the user's: the reference recipe
    programs = tax_programs(args.nproc, steps=args.steps, overrides=args.overrides) if recipe else None
    result = tax(args.out, command=args.cmd or None, command_a=args.cmd_a, command_b=args.cmd_b, programs=programs,
                 pairs=args.pairs, warmup=args.warmup, gate=args.gate, resamples=args.resamples,
                 confidence=args.confidence, seed=args.seed, run_timeout=args.run_timeout,
                 progress=progress_for(args))
    return print_result(result, args.json, render)


def render(result: TaxResult) -> str:
    data = result.to_dict()
    low, high = result.ci
    head = (f"{result.verdict.value.upper()}: determinism tax {result.ratio:.3f}x; {result.judgement}\n"
            f"estimator: {data['estimator']}, the medians below")
    rows = [[label, f"{1000 * data['median_step_s'][label]:.2f}", result.commands[label]]
            for label in ("deterministic", "baseline")]
    lines = [head, "", table(["run", "median step (ms)", "command"], rows), "",
             f"{result.pairs} pair(s) interleaved, {data['steps_per_run']} step(s) timed per run after "
             f"{result.warmup} warm-up step(s); {result.resamples} paired bootstrap resamples (seed {result.seed}); "
             f"runs in {result.out}"]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
