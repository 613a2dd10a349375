"""`samebits show RUN`: summarise a recorded run (ranks, steps, records, environment)."""

from __future__ import annotations

from samebits.cli._format import escape, print_json, table
from samebits.stream import open_run


def register(sub) -> None:
    parser = sub.add_parser("show", help="summarise a recorded run",
                            description="Summarise a run directory: ranks, steps, records, environment.")
    parser.add_argument("run", metavar="RUN")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=run)


def summarise(path) -> dict:
    """Per-rank counts and status; every frame is verified (a damaged stream raises)."""
    run_dir = open_run(path)
    ranks = []
    for rank in run_dir.ranks:
        reader = run_dir.stream(rank)
        num_steps = num_records = 0
        first = last = None
        try:
            for block in reader.steps():
                num_steps += 1
                num_records += block.num_records
                first = block.step if first is None else first
                last = block.step
        finally:
            reader.close()
        ranks.append({
            "rank": rank, "steps": num_steps, "first_step": first, "last_step": last,
            "records": num_records, "bytes": reader.size, "segments": reader.num_segments,
            "status": "closed" if reader.closed_cleanly else (reader.stop_reason or "open"),
            "coords": reader.header.get("coords", {}),
        })
    header = run_dir.header
    return {"run": str(path), "run_id": header.get("run_id"), "world_size": run_dir.world_size,
            "ranks": ranks, "config": header.get("config", {}), "environment": header.get("environment", {}),
            "determinism": header.get("determinism"), "window": header.get("window")}


def run(args) -> int:
    summary = summarise(args.run)
    if args.json:
        print_json(summary)
        return 0
    env = summary["environment"]
    print(escape(f"run {summary['run']}  (id {summary['run_id']}, world size {summary['world_size']}, "
                 f"{len(summary['ranks'])} rank(s) recorded)"))
    rows = [[r["rank"], r["steps"], f"{r['first_step']}..{r['last_step']}" if r["steps"] else "-",
             f"{r['records']:,}", f"{r['bytes']:,}",
             " ".join(f"{k}={v}" for k, v in r["coords"].items()) or "-", r["status"]]
            for r in summary["ranks"]]
    print(table(["rank", "steps", "range", "records", "bytes", "coords", "status"], rows))
    print(escape(f"environment: python {env.get('python')}, torch {env.get('torch')}, device {env.get('device')}, "
                 f"{env.get('num_threads')} thread(s), host {env.get('hostname')}"))
    if summary["config"]:
        config = ", ".join(f"{k}={v}" for k, v in list(summary["config"].items())[:12])
        more = len(summary["config"]) - 12
        print(escape(f"config: {config}" + (f", ... ({more} more; --json for all)" if more > 0 else "")))
    return 0
