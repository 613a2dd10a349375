"""`samebits diff RUN_A RUN_B`: are two runs bitwise identical?  If not, where first?"""

from __future__ import annotations

from samebits.cli._format import escape, print_json, table
from samebits.compare import DiffResult, diff
from samebits.errors import IncomparableRunsError
from samebits.verdicts import EXIT_CANNOT_RUN, Verdict


def register(sub) -> None:
    parser = sub.add_parser(
        "diff",
        help="compare two recorded runs bit for bit",
        description="Compare two run directories bit for bit. Every frame's checksum is checked and every "
                    "step root recomputed. Exit 0 identical, 1 diverged, 2 could not compare (a stream "
                    "damaged, missing or cut short, or a window holding no step).",
    )
    parser.add_argument("run_a", metavar="RUN_A")
    parser.add_argument("run_b", metavar="RUN_B")
    parser.add_argument("--from-step", type=int, default=None, help="compare steps >= this (e.g. a resume step)")
    parser.add_argument("--to-step", type=int, default=None, help="compare steps < this")
    parser.add_argument("--allow-config-diff", action="store_true",
                        help="compare even if configs or recorded names differ (intended changes)")
    parser.add_argument("--verify", action="store_true",
                        help="decode and compare every step's records, not only steps whose recomputed roots differ")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        result = diff(args.run_a, args.run_b, start_step=args.from_step, stop_step=args.to_step,
                      allow_config_diff=args.allow_config_diff, verify=args.verify)
    except IncomparableRunsError as err:
        if args.json:
            print_json({"verdict": "incomparable", "error": str(err), "differences": err.differences})
            return EXIT_CANNOT_RUN
        raise
    if args.json:
        print_json(result.to_json())
    else:
        print(render(result))
    return result.verdict.exit_code


def render(result: DiffResult, title: str | None = None) -> str:
    """The people-readable verdict: a headline, a table of the first divergence, counts."""
    c = result.compared
    counts = (f"{c['ranks']} rank(s) x {c['steps']} step(s), {c['records']:,} records compared"
              f" ({c['steps_identical_by_root']} step(s) equal by root)")
    lines = [escape(title or f"samebits diff {result.a} {result.b}")]
    if result.verdict is Verdict.IDENTICAL:
        lines.append(f"IDENTICAL: bit for bit. {counts}")
    elif result.verdict is Verdict.INCOMPLETE:
        lines.append("INCOMPLETE: could not decide (no divergence found in what was compared, but not "
                     "everything could be compared)")
        lines.extend(f"  - {escape(reason)}" for reason in result.incomplete)
        lines.append(f"compared: {counts}")
    else:
        d = result.first_divergence
        where = f"{d.phase}/{d.name}" if d.name is not None else d.detail
        lines.append(f"DIVERGED at step {d.step}, rank {d.rank}: {escape(where)}")
        rows = []
        for rank, div in sorted(result.divergences.items(), key=lambda kv: (kv[1].step, kv[1].position, kv[0])):
            rows.append([
                div.step, rank, div.phase or "-", (div.name or "-") + (f" #{div.occurrence}" if div.occurrence else ""),
                _side(div.a, div), _side(div.b, div), div.records_differing,
            ])
        lines.append("")
        lines.append(table(["step", "rank", "phase", "name", "a", "b", "records differing"], rows[:16]))
        if len(rows) > 16:
            lines.append(f"... and {len(rows) - 16} more rank(s)")
        lines.append("")
        lines.append(f"ranks diverged first (step {d.step}): {', '.join(map(str, result.ranks_diverged_first))}")
        if d.reason.startswith("ended") or d.reason.startswith("only"):
            lines.append(escape(d.detail))
        lines.append(f"before it: {counts}")
    for note in result.notes:
        lines.append(f"note: {escape(note)}")
    return "\n".join(lines)


def _side(rec: dict | None, div) -> str:
    if rec is None:
        return "(missing)" if div.name else "-"
    if rec["kind"] == "metric":
        return f"{rec['value']!r} [{rec['bits']}]"
    shape = "x".join(map(str, rec["shape"])) or "scalar"
    return f"{shape} {rec['dtype']} {rec['digest'] or ('absent' if rec.get('absent') else 'capped')}"
