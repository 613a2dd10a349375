"""`samebits show RUN`: summarise a recorded run (ranks, steps, records, environment), or list
what one step recorded (`--records`)."""

from __future__ import annotations

from samebits.cli._format import echo, escape, print_json, table
from samebits.cli._lazy import lazy
from samebits.cli._options import check_input_directory, step_number
from samebits.verdicts import EXIT_OK

catalogue, summarise = lazy("samebits.stream", "catalogue", "summarise")


EXAMPLES = """\
samebits show runs/a
samebits show runs/a --records --step 0
"""


def register(sub) -> None:
    parser = sub.add_parser("show", help="summarise a recorded run, or list what it recorded",
                            description="Summarise a run directory: ranks, steps, records, environment. "
                                        "With --records: every name one step recorded (phase, name, dtype, "
                                        "shape), to choose what to record with --phases/--include/--exclude.")
    parser.add_argument("run", metavar="RUN", help="a run directory (its rank-NNNNN.sbs streams)")
    parser.add_argument("--records", action="store_true", help="list the records of one step (default: the first)")
    parser.add_argument("--step", type=step_number, default=None, help="with --records: this step")
    parser.add_argument("--rank", type=step_number, default=None, help="with --records: this rank (default: the lowest)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    check_input_directory(args.run)
    if args.records:
        return show_records(args)
    summary = summarise(args.run)
    if args.json:
        print_json(summary)
        return EXIT_OK
    env = summary["environment"]
    echo(f"run {summary['run']}  (id {summary['run_id']}, world size {summary['world_size']}, "
         f"{len(summary['ranks'])} rank(s) recorded)")
    rows = [[r["rank"], r["steps"], f"{r['first_step']}..{r['last_step']}" if r["steps"] else "-",
             f"{r['records']:,}", f"{r['bytes']:,}",
             " ".join(f"{k}={v}" for k, v in r["coords"].items()) or "-", r["status"]]
            for r in summary["ranks"]]
    echo(table(["rank", "steps", "range", "records", "bytes", "coords", "status"], rows))
    echo(f"environment: python {env.get('python')}, torch {env.get('torch')}, device {env.get('device')}, "
         f"{env.get('num_threads')} thread(s), host {env.get('hostname')}")
    chosen = {k: v for k, v in summary["selection"].items() if v}
    if chosen:
        echo("recorded only: " + ", ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                                           for k, v in chosen.items()))
    if summary["config"]:
        config = ", ".join(f"{k}={v}" for k, v in list(summary["config"].items())[:12])
        more = len(summary["config"]) - 12
        echo(f"config: {config}" + (f", ... ({more} more; --json for all)" if more > 0 else ""))
    echo(f"what one step recorded: samebits show {escape(args.run)} --records")
    return EXIT_OK


def show_records(args) -> int:
    rank, step, entries = catalogue(args.run, rank=args.rank, step=args.step)
    if args.json:
        print_json({"run": str(args.run), "rank": rank, "step": step, "records": [e.to_dict() for e in entries]})
        return EXIT_OK
    phases = sorted({e.phase for e in entries})
    echo(f"rank {rank}, step {step}: {len(entries)} name(s) in {len(phases)} phase(s) ({', '.join(phases)})")
    rows = [[e.phase, e.name, e.kind, e.dtype, "x".join(map(str, e.shape)) if e.shape else "scalar" if e.shape == () else "-",
             e.count if e.count > 1 else "", "" if e.digested else "no digest"] for e in entries]
    echo(table(["phase", "name", "kind", "dtype", "shape", "times", ""], rows))
    echo("choose with: samebits run/verify --phases P,Q --include 'phase/glob' --exclude 'glob'")
    return EXIT_OK
