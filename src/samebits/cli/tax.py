"""`samebits tax [-- CMD] [--gate 1.05] [--budget 300]`: the determinism tax as a ratio with a confidence
interval, measured in interleaved pairs until the interval decides the gate or the time budget ends."""

from __future__ import annotations

import math

from samebits.cli._format import print_result, table
from samebits.cli._options import (add_out_option, add_progress_options, add_recipe_options, add_run_timeout_option,
                                   check_out_directory,
                                   int_range, open_unit_interval, positive_int, progress_for, step_number)
from samebits.cli._lazy import lazy
from samebits.cli._recipe import tax_programs
from samebits.defaults import DEFAULT_GATE
from samebits.errors import ConfigError

TaxResult, tax = lazy("samebits.runners.tax", "TaxResult", "tax")
ZeroCode = lazy("samebits.runners.program", "ZeroCode")

# Restated from samebits.runners.tax (importing it would load numpy and torch before parsing).
DEFAULT_PAIRS = 4
DEFAULT_BUDGET_S = 300
# A run of the recipe is mostly start-up (about 4 s here) and a step about 40 ms: 30 steps give each pair
# 27 timed steps for about 15% more time than 12 steps.
DEFAULT_RECIPE_STEPS = 30
MAX_BUDGET_S = 7 * 24 * 3600
# torch-free: the library's own argument checks, made before the library is loaded
tax_commands = lazy("samebits.runners.commands", "tax_commands")


EXAMPLES = """\
samebits tax --pairs 5                         # the reference recipe
samebits tax -- python train.py --deterministic {deterministic}
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "tax",
        help="measure how much slower deterministic mode is (paired runs until the interval decides the gate)",
        description="Run the deterministic command and the baseline in interleaved pairs, take the step times "
                    "from the recorded streams, and report the tax (the geometric mean of paired step-time ratios) "
                    "with a confidence interval. Pairs are added until the interval clears --gate or --budget "
                    "seconds are spent. With no command: the reference recipe with deterministic=true/false. With "
                    "-- CMD: {deterministic} in the command becomes 1, then 0. With --a/--b: two commands. Exit 0 "
                    "when the interval is at most --gate, 1 when it is wholly over, 2 when it still spans the gate "
                    "(inconclusive: the output estimates the pairs and time that would decide it) or a run failed. "
                    "Protocol: docs/tax.md.",
    )
    parser.add_argument("--gate", type=float, default=DEFAULT_GATE,
                        help=f"pass when the interval's upper bound is at most this ratio, fail when its lower bound is over "
                             f"it (default {DEFAULT_GATE})")
    parser.add_argument("--pairs", type=positive_int, default=DEFAULT_PAIRS,
                        help=f"pairs before the first look at the interval (default {DEFAULT_PAIRS}); with --budget 0, "
                             "exactly this many")
    parser.add_argument("--budget", type=int_range(0, MAX_BUDGET_S, DEFAULT_BUDGET_S), default=DEFAULT_BUDGET_S,
                        metavar="SECONDS",
                        help=f"add pairs (looking each time they double) until the interval decides the gate or another "
                             f"pair would end after this many seconds of runs (default {DEFAULT_BUDGET_S}); the first "
                             "--pairs always run; 0: exactly --pairs pairs, one look")
    parser.add_argument("--warmup", type=step_number, default=2, help="timed steps dropped at the start of each run (default 2)")
    add_recipe_options(parser, steps=DEFAULT_RECIPE_STEPS, nproc=1)
    parser.add_argument("--a", dest="cmd_a", default=None, metavar="'CMD'", help="the deterministic command, quoted")
    parser.add_argument("--b", dest="cmd_b", default=None, metavar="'CMD'", help="the baseline command, quoted")
    parser.add_argument("--confidence", type=open_unit_interval, default=0.95,
                        help="the chance that no look gives a wrong PASS or FAIL, between 0 and 1 (default 0.95)")
    add_run_timeout_option(parser)
    add_out_option(parser, "tax")
    add_progress_options(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("cmd", nargs="*", metavar="-- CMD", help="a command holding {deterministic}")
    parser.set_defaults(func=run)


def run(args) -> int:
    if not math.isfinite(args.gate):  # the library refuses a gate <= 0; nan or inf would decide nothing
        raise ConfigError(f"--gate {args.gate}: a ratio gate is a positive finite number, e.g. 1.05.")
    command = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    commands = tax_commands(command, args.cmd_a, args.cmd_b)  # refused before torch is loaded
    check_out_directory(args.out)
    if commands is None:  # no command of the user's: the reference recipe
        programs = tax_programs(args.nproc, steps=args.steps, overrides=args.overrides)
    else:
        programs = {label: ZeroCode(tuple(argv)) for label, argv in commands.items()}
    result = tax(args.out, programs=programs, pairs=args.pairs, budget_s=float(args.budget), warmup=args.warmup,
                 gate=args.gate, confidence=args.confidence, run_timeout=args.run_timeout,
                 progress=progress_for(args))
    return print_result(result, args.json, render)


def render(result: TaxResult) -> str:
    data = result.to_dict()
    est = result.estimate
    head = (f"{result.verdict.value.upper()}: determinism tax {result.ratio:.3f}x; {result.judgement}\n"
            f"estimator: {data['estimator']}; the typical steps below are the geometric means of the same steps, "
            "and their quotient is the tax")
    rows = [[label, f"{1000 * est.typical_step_s[label]:.2f}", result.commands[label]]
            for label in ("deterministic", "baseline")]
    if est.unit == "steps" and est.pairs > 1:
        samples = (f"steps counted as samples: the pairs agree as closely as their step noise predicts "
                   f"(F {est.pooling_f:.2f}, p {est.pooling_p:.2g} > {data['pooling']['alpha']})")
    elif est.unit == "steps":
        samples = "one pair: the interval holds step-to-step noise only, not run-to-run variation"
    else:
        test = f" (F {est.pooling_f:.2f}, p {est.pooling_p:.2g} <= {data['pooling']['alpha']})" \
            if est.pooling_f is not None else ""
        samples = (f"pairs counted as samples: the pairs differ more than their step noise explains{test}, so "
                   "steps of one run are not independent samples")
    budget = f", budget {result.budget_s:.0f} s" if result.budget_s > 0 else ""
    lines = [head, "", table(["run", "typical step (ms)", "command"], rows), "",
             f"{result.pairs} pair(s) interleaved in {result.elapsed_s:.0f} s{budget}, {result.looks} look(s); "
             f"{est.steps_per_pair} step(s) timed per run after {result.warmup} warm-up step(s), the middle "
             f"{est.steps_kept} step ratios of each pair kept; {samples}; runs in {result.out}"]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)
