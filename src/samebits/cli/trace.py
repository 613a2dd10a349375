"""`samebits trace RUN_A RUN_B`: classify the first difference of every rank of two traced runs."""

from __future__ import annotations

from samebits.cli._format import print_result, table
from samebits.cli._options import check_input_directory, step_number
from samebits.cli._lazy import lazy
from samebits.verdicts import Verdict

find_origins = lazy("samebits.trace", "find_origins")


EXAMPLES = """\
samebits trace runs/a runs/b                   # runs recorded with SAMEBITS_TRACE=ops
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "trace",
        help="origin or receiver: classify where two traced runs part",
        description="For each rank, find the first differing record of two runs recorded with "
        "SAMEBITS_TRACE=phases|modules|ops and say whether it is an origin (its inputs matched, its "
        "output did not) or a receiver (an input already differed). Exit 0 identical, 1 diverged, "
        "2 nothing compared.",
    )
    parser.add_argument("run_a", metavar="RUN_A", help="run directory A")
    parser.add_argument("run_b", metavar="RUN_B", help="run directory B")
    parser.add_argument("--step", type=step_number, default=None, help="look only at this step")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    check_input_directory(args.run_a)
    check_input_directory(args.run_b)
    report = find_origins(args.run_a, args.run_b, step=args.step)
    return print_result(report, args.json, render)


def render(report) -> str:
    if report.verdict is Verdict.INCOMPLETE:
        return f"samebits trace: INCOMPLETE ({report.a} vs {report.b}): " + "; ".join(report.notes)
    if report.identical:
        return f"samebits trace: IDENTICAL ({report.a} = {report.b})"
    rows = []
    for rank, finding in sorted(report.findings.items()):
        what = finding.event_id or finding.record or ""
        rows.append([rank, finding.step, finding.classification, finding.phase or "",
                     "" if finding.module is None else (finding.module or "(root)"), finding.op or "", what])
    lines = [f"samebits trace: DIVERGED ({report.a} vs {report.b})", "",
             table(["rank", "step", "class", "phase", "module", "op", "event"], rows), ""]
    if report.origins:
        lines.append("origins, earliest first:")
        for finding in report.origins:
            lines.append(f"  {finding.where()}" + (f"  [{finding.call_site}]" if finding.call_site else ""))
            lines.append(f"    {finding.detail}")
            if finding.state_differs:
                lines.append(f"    state differing at the step's start: {', '.join(finding.state_differs)}")
    else:
        first = report.first
        lines.append(f"no origin among the traced records; first difference: {first.where()}: {first.detail}")
    lines += [f"note: {note}" for note in report.notes]
    return "\n".join(lines)
