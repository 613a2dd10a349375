"""`samebits probe -- CMD`: run a training command with every op executed several times and
list the ops that gave different bits here.  Exit 0 clean, 1 findings, 2 could not run.
"""

from __future__ import annotations

import argparse
import os
import sys

from samebits.cli._format import echo, print_json, table
from samebits.cli._lazy import lazy
from samebits.errors import ConfigError
from samebits.cli._options import add_stop_after_option, int_range
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

probe_command, lookup_op = lazy("samebits.determinism", "probe_command", "lookup_op")

# Kept here, not imported, so `samebits probe --help` and argument errors load no torch;
# tests/test_probe.py checks they equal samebits.determinism._probe's.
DEFAULT_COMPARISONS = 10
MIN_COMPARISONS = 2
_NAMES_SHOWN = 8  # op names listed per line of ops that compute nothing


EXAMPLES = """\
samebits probe --stop-after 0 -- python train.py   # end it after its first step
"""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "probe", help="run a command with every op executed several times; list nondeterministic ops",
        description="Run CMD (a Python program, or a launcher such as torchrun) with every "
                    "ATen op executed several times on identical inputs, and list the ops whose "
                    "results differ bit for bit, and the ops that ran once, uncompared.  Each op "
                    "signature (op, shapes, dtypes) is compared --comparisons times on its first "
                    "call, once on later calls.  Example: "
                    "samebits probe --stop-after 0 -- python train.py")
    add_stop_after_option(parser, "end the program after this optimizer step (0: after one step; default: run "
                                  "it all)")
    parser.add_argument("--comparisons", type=int_range(MIN_COMPARISONS, 10_000, 20),
                        default=DEFAULT_COMPARISONS, metavar="N",
                        help="compare each op signature at least N times (default "
                             f"{DEFAULT_COMPARISONS}): a race that gives an op other bits in a "
                             "fraction p of its executions is missed with probability <= (1-p)^N")
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
    if not command:  # refused here, before torch is loaded (probe_command refuses it too)
        raise ConfigError("no command to probe: write it after '--', e.g. samebits probe -- python train.py")
    namespaces = tuple(args.namespace) if args.namespace else None
    result = probe_command(command, steps=None if args.stop_after is None else args.stop_after + 1, namespaces=namespaces,
                           comparisons=args.comparisons, stdout=sys.stderr if args.json else None)
    code = EXIT_CANNOT_RUN if not result.ran else EXIT_BAD_VERDICT if result.findings else EXIT_OK
    if args.json:
        print_json(result.to_dict())
        return code
    # Launchers (torchrun's agent) run no ops: count the processes that did.
    working = [p for p in result.processes if p["num_ops"]]
    multi = len(working) > 1
    num_ops = sum(p["num_ops"] for p in working)
    compared = sum(p["num_ops_compared"] for p in working)
    signatures = sum(p.get("num_signatures") or 0 for p in working)
    echo(f"\nsamebits probe: {compared} of {num_ops} op calls compared ({signatures} op "
         f"signatures, each at least {result.comparisons} times) in {len(working)} process(es)")
    if result.findings:
        headers = (["OP", "MODULE", "CALL SITE", "DIFFERING", "CALLS", "EXECUTIONS"]
                   + (["RANK"] if multi else []))
        rows = [[f["op"], f["module"] or "-", f["call_site"] or "-",
                 f"{f['elements_differing']}/{f['numel']}", f"{f['calls_differing']}/{f['calls']}",
                 f"{f.get('comparisons_differing', '?')}/{f.get('comparisons', '?')}"]
                + ([f["rank"] if f["rank"] is not None else f"pid {f['pid']}"] if multi else [])
                for f in result.findings]
        echo(table(headers, rows))
        echo(f"\n{len(result.findings)} nondeterministic op call site(s) (EXECUTIONS: compared "
             "executions that differed from the call's first).")
        for op in dict.fromkeys(f["op"] for f in result.findings):
            entries = lookup_op(op)
            if entries:
                echo(f"  {op}: deterministic alternative: {entries[0].alternative}")
    _print_not_compared(result.not_compared)
    if result.clean:
        echo(f"\nclean: no compared op gave different bits; {result.bound['summary']}."
             "  Rarer races can pass, and so can races that come in bursts (threads of a busy "
             "machine): raise --comparisons, probe more steps, prove a fix with paired runs.")
    elif result.findings and result.bound is not None:
        echo(f"\nThe other ops: {result.bound['summary']}.")
    busy = _busy()
    if busy and not result.findings:
        echo(f"note: the machine was busy ({busy}): a race between threads shows only when they "
             "run at once, so it shows less often here than on an idle machine")
    for problem in result.problems:
        echo(f"samebits probe: {problem}", file=sys.stderr)
    return code


def _busy() -> str | None:
    """'load 8.0 on 2 CPUs' when the load average is above the CPU count, else None."""
    try:
        load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):  # no load average on this platform
        return None
    return f"load {load:.1f} on {cpus} CPUs" if load > cpus else None


def _print_not_compared(entries: list[dict]) -> None:
    """The ops that ran once: those that may compute something as a table, the others
    (views, uninitialised outputs) one line per reason."""
    never = [e for e in entries if not e["calls_compared"]]
    if not never:
        return
    may_compute = [e for e in never if not e["computes_nothing"]]
    echo(f"\nNot compared: {len(never)} op(s) ran once in every call, so a race in them cannot show here:")
    if may_compute:
        echo(table(["OP", "CALLS", "WHY NOT COMPARED"], [[e["op"], e["calls"], e["reason"]]
                                                          for e in may_compute]))
    by_reason: dict[str, list[dict]] = {}
    for entry in never:
        if entry["computes_nothing"]:
            by_reason.setdefault(entry["reason"], []).append(entry)
    for reason, group in by_reason.items():
        names = [e["op"] for e in group]
        shown = ", ".join(names[:_NAMES_SHOWN]) + (f" and {len(names) - _NAMES_SHOWN} more"
                                                   if len(names) > _NAMES_SHOWN else "")
        echo(f"  {reason} ({sum(e['calls'] for e in group)} calls): {shown}")
    partly = len(entries) - len(never)
    if partly:
        echo(f"  and {partly} op(s) compared in some calls, not in others (--json: not_compared)")
