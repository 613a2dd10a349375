"""`samebits bisect [-- CMD ...] | --a CMD --b CMD`: narrow a divergence to its origin op."""

from __future__ import annotations

import shlex

from samebits.cli._format import print_result, table
from samebits.cli._options import (add_out_option, add_progress_options, add_recipe_options, add_run_timeout_option,
                                   add_stop_after_option, check_out_directory, progress_for,
                                   step_number)
from samebits.cli._lazy import lazy
from samebits.cli._recipe import recipe_program
from samebits.errors import ConfigError

bisect = lazy("samebits.runners.bisect", "bisect")
bisect_conclusion = lazy("samebits.runners.conclusion", "bisect_conclusion")
# torch-free: the library's own argument checks, made before the library is loaded
check_bisect_arguments = lazy("samebits.runners.commands", "check_bisect_arguments")


EXAMPLES = """\
samebits bisect --nondeterministic            # the recipe's planted fault, found to its op
samebits bisect --a 'python train.py' --b 'python train.py --threads 2'
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "bisect",
        help="find the op where two runs first part (origin, not symptom)",
        description="Run twice at rung 1 (phases, collectives) to find the first divergent step and phase, "
        "re-run that step at rung 2 (modules), then rung 3 (ATen ops) inside the module, then dump the "
        "origin op's outputs. With no command: the reference recipe. With --a/--b: two commands (a code "
        "change, an upgrade, a thread count), each first checked for repeatability. With --b-step-offset K: "
        "B resumes A's checkpoint of step K, and only steps >= K are compared (a resume that `samebits "
        "verify --resume-with` found differs). With no command and --resume-at K: the recipe's resume (its A "
        "saves at step K, its B resumes there; what `samebits verify` found differs in its run C). "
        "Exit 0 identical, 1 diverged, 2 could not run.",
    )
    parser.add_argument("--a", dest="cmd_a", default=None, metavar="'CMD'", help="side A, a quoted command")
    parser.add_argument("--b", dest="cmd_b", default=None, metavar="'CMD'", help="side B, a quoted command")
    parser.add_argument("--b-step-offset", dest="b_step_offset", type=step_number, default=None, metavar="K",
                        help="side B resumes at step K (A's checkpoint of step K): its steps are numbered from "
                        "K, and every stage compares and traces only steps >= K (needs --a and --b)")
    parser.add_argument("--resume-at", dest="resume_at", type=step_number, default=None, metavar="K",
                        help="the reference recipe's resume: A saves a checkpoint at step K and B resumes it; "
                        "only steps >= K are compared (no command; for your own, --b-step-offset)")
    add_out_option(parser, "bisect")
    add_progress_options(parser)
    add_stop_after_option(parser)
    add_run_timeout_option(parser)
    add_recipe_options(parser, steps=4, nproc=2, nondeterministic=True)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("cmd", nargs="*", metavar="-- CMD", help="a command to bisect against itself")
    parser.set_defaults(func=run)


def run(args) -> int:
    if args.cmd and (args.cmd_a or args.cmd_b):
        raise ConfigError("give either a command after -- (bisected against itself) or --a and --b, not both.")
    if bool(args.cmd_a) != bool(args.cmd_b):
        raise ConfigError("--a and --b go together: give both quoted commands, e.g. "
                            "--a 'python train.py' --b 'python train.py --threads 2'.")
    cmd_a = shlex.split(args.cmd_a) if args.cmd_a else (args.cmd or None)
    cmd_b = shlex.split(args.cmd_b) if args.cmd_b else None
    # Checked before the library (and torch) is loaded: a mistake costs no second of start-up.
    check_bisect_arguments(cmd_a, cmd_b, args.b_step_offset, args.resume_at, None if cmd_a else args.steps)
    check_out_directory(args.out)

    progress = progress_for(args)  # stderr, each line after the elapsed time; each run's steps live
    if cmd_a is None:
        progress(f"samebits bisect: the reference recipe, {args.nproc} rank(s), {args.steps} steps"
                 + (", nondeterministic path" if args.nondeterministic else "")
                 + (f"; b resumes a's checkpoint of step {args.resume_at}" if args.resume_at is not None else ""))
    else:
        progress(f"samebits bisect: a = {shlex.join(cmd_a)}" + (f"\n                 b = {shlex.join(cmd_b)}"
                                                                 if cmd_b else " (twice)")
                 + (f"\n                 b resumes at step {args.b_step_offset}; steps >= "
                    f"{args.b_step_offset} compared" if args.b_step_offset is not None else ""))
    program = None if cmd_a else recipe_program(args.nproc, steps=args.steps, overrides=args.overrides,
                                                nondeterministic=args.nondeterministic)
    result = bisect(cmd_a, cmd_b, out=args.out, program=program,
                    stop_after=args.stop_after, run_timeout=args.run_timeout,
                    b_step_offset=args.b_step_offset, resume_at=args.resume_at, progress=progress)
    return print_result(result, args.json, render)


def render(result) -> str:
    rows = [[f"{i}. {s.name}", s.rung, s.scope, " ".join(f"{k} {v:.1f}s" for k, v in s.runs.items()),
             s.summary] for i, s in enumerate(result.stages, 1)]
    lines = [f"samebits bisect: {result.verdict.upper()} ({result.compared})", "",
             table(["stage", "rung", "traced", "runs", "finding"], rows), ""]
    origin = result.origin
    lines.append(bisect_conclusion(result))  # the sentence `samebits report` leads with
    lines.append("")
    if result.control_flow is not None:
        cf = result.control_flow
        lines.append(f"control flow differs: rank {cf.rank}, step {cf.step}: {cf.detail}")
    if origin is not None and origin.classification != "control_flow":
        kind = "origin" if origin.classification == "origin" else f"first difference ({origin.classification})"
        lines.append(f"{kind}: rank {origin.rank}, step {origin.step}, phase {origin.phase}")
        if origin.module is not None:
            lines.append(f"  module     {origin.module or '(root)'}")
        if origin.op:
            lines.append(f"  op         {origin.op}   (id {origin.event_id})")
        elif origin.event_id:
            lines.append(f"  event      {origin.event_id} ({origin.category})")
        state = origin.state_differs and f"differs at step start: {', '.join(origin.state_differs)}"
        lines += [f"  {label:<10} {value}" for label, value in
                  (("call site", origin.call_site), ("why", origin.detail), ("state", state)) if value]
        elements = origin.elements
        if elements:
            lines.append(f"  elements   {elements.differing} of {elements.total} differ in output "
                         f"{elements.output} ({elements.dtype} {elements.shape}), max "
                         f"{elements.max_ulp} ulp"
                         + ("; the same values in another order" if elements.same_values else ""))
            for value in elements.values:
                lines.append(f"             at {value.index}: a = {value.a!r}, b = {value.b!r} "
                             f"({value.ulp} ulp)")
        if origin.catalog:
            lines.append(f"  known op   {origin.catalog}")
    lines += [f"note: {note}" for note in result.notes]
    lines.append(f"wall time {result.seconds:.1f} s; streams, logs and summary.json in {result.out}")
    return "\n".join(lines)
