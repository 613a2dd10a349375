"""`samebits probe -- CMD`: run a training command with every op executed twice and list
the ops that gave different bits on this machine.

Exit 0 clean, 1 findings, 2 could not run (command failed, probe did not start).
"""

from __future__ import annotations

import argparse
import sys

from samebits.cli._format import echo, print_json, table
from samebits.cli._lazy import lazy
from samebits.cli._options import positive_int
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

probe_command, lookup_op = lazy("samebits.determinism", "probe_command", "lookup_op")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe", help="run a command with every op executed twice; list nondeterministic ops",
        description="Run CMD (a Python program, or a launcher such as torchrun) with every "
                    "ATen op executed twice on identical inputs, and list the ops whose two "
                    "results differ bit for bit.  Example: "
                    "samebits probe --steps 1 -- python train.py")
    parser.add_argument("--steps", type=positive_int, metavar="N",
                        help="stop the program after N optimizer steps (default: run it all)")
    parser.add_argument("--namespace", action="append", metavar="NS", default=None,
                        help="op namespace to probe (repeatable; default aten, prims, samebits)")
    parser.add_argument("--json", action="store_true",
                        help="print JSON (the command's own stdout goes to stderr)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD",
                        help="the command to run, after '--'")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = list(args.cmd)
    if command and command[0] == "--":
        command = command[1:]
    namespaces = tuple(args.namespace) if args.namespace else None
    result = probe_command(command, steps=args.steps, namespaces=namespaces,
                           stdout=sys.stderr if args.json else None)
    code = EXIT_CANNOT_RUN if not result.ran else EXIT_BAD_VERDICT if result.findings else EXIT_OK
    if args.json:
        print_json(result.to_dict())
        return code
    # Launchers (torchrun's agent) run no ops: count the processes that did.
    working = [p for p in result.processes if p["num_ops"]]
    multi = len(working) > 1
    num_ops = sum(p["num_ops"] for p in working)
    compared = sum(p["num_ops_compared"] for p in working)
    echo(f"\nsamebits probe: {compared} of {num_ops} ops executed twice and compared "
          f"in {len(working)} process(es)")
    if result.findings:
        headers = ["OP", "MODULE", "CALL SITE", "DIFFERING", "CALLS"] + (["RANK"] if multi else [])
        rows = [[f["op"], f["module"] or "-", f["call_site"] or "-",
                 f"{f['elements_differing']}/{f['numel']}", f"{f['calls_differing']}/{f['calls']}"]
                + ([f["rank"] if f["rank"] is not None else f"pid {f['pid']}"] if multi else [])
                for f in result.findings]
        echo(table(headers, rows))
        echo(f"\n{len(result.findings)} nondeterministic op call site(s).")
        for op in dict.fromkeys(f["op"] for f in result.findings):
            entries = lookup_op(op)
            if entries:
                echo(f"  {op}: deterministic alternative: {entries[0].alternative}")
    elif result.ran:
        echo("clean: every compared op gave the same bits twice")
    for problem in result.problems:
        echo(f"samebits probe: {problem}", file=sys.stderr)
    return code
