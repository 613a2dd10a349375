"""`samebits dump RUN --rank R --step S`: print one step's records as text."""

from __future__ import annotations

from samebits.cli._format import echo, print_json, table
from samebits.cli._options import check_input_directory, step_number
from samebits.cli._lazy import lazy
from samebits.errors import SamebitsError
from samebits.verdicts import EXIT_OK

open_run = lazy("samebits.stream", "open_run")


EXAMPLES = """\
samebits dump runs/a --rank 0 --step 3 --phase grads
"""


def register(sub) -> None:
    parser = sub.add_parser("dump", help="print the records of one rank and step",
                            description="Print the records of one rank at one step (or all steps).")
    parser.add_argument("run", metavar="RUN", help="a run directory (its rank-NNNNN.sbs streams)")
    parser.add_argument("--rank", type=step_number, default=0, metavar="R", help="the rank to print (default 0)")
    parser.add_argument("--step", type=step_number, default=None, metavar="S",
                        help="the step to print (default: every step; `samebits show RUN` lists them)")
    parser.add_argument("--phase", default=None, help="only records of this phase")
    parser.add_argument("--json", action="store_true", help="print records as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    check_input_directory(args.run)
    run_dir = open_run(args.run)
    reader = run_dir.stream(args.rank)
    run_dir.close()
    out, found = [], False
    for block in reader.steps():
        if args.step is not None and block.step != args.step:
            if block.step > args.step:
                break
            continue
        found = True
        records = [r for r in block.records() if args.phase is None or r.phase == args.phase]
        out.append({"step": block.step, "root": f"{block.root:016x}", "records": records})
    if args.step is not None and not found:
        raise SamebitsError(f"{reader.path}: no step {args.step} on rank {args.rank}; "
                            "`samebits show RUN` lists the recorded steps.")
    if args.json:
        print_json([{"step": s["step"], "root": s["root"], "records": [r.to_dict() for r in s["records"]]} for s in out])
        return EXIT_OK
    for s in out:
        echo(f"step {s['step']}  rank {args.rank}  root {s['root']}  ({len(s['records'])} records)")
        echo(table(["phase", "name", "#", "kind", "value"],
                   [[r.phase, r.name, r.occurrence, r.kind, r.summary()] for r in s["records"]]))
        echo()
    return EXIT_OK
