"""`samebits report OUTPUT_DIR | RUN_A RUN_B -o report.html`: one self-contained HTML page."""

from __future__ import annotations

import sys

from samebits.cli._format import echo, print_json, progress_printer, table
from samebits.cli._options import check_input_directory
from samebits.cli._lazy import lazy

write_report = lazy("samebits.runs.report", "write_report")


def register(sub) -> None:
    parser = sub.add_parser(
        "report",
        help="write one self-contained HTML page of a verify, bisect, matrix or diff",
        description="Write one HTML file (no network, no scripts: open it anywhere) that leads with the "
                    "conclusion the command printed, then the verdicts, the growth of the difference in ulps per "
                    "step (log scale), the metric curves of both runs (loss, grad norm, lr; a solid, b dashed), a "
                    "heatmap of where the runs differ (record groups or ranks x steps), the records that differ "
                    "step by step, the origin of a bisection and the difference between the runs' "
                    "environments. Give the output directory of samebits verify, bisect or "
                    "matrix, or two run directories (compared here). Exit code: that of the verdict shown "
                    "(0 good, 1 bad, 2 could not decide or could not run, 3 the command was stopped before it finished: "
                    "its summary.json says so).",
    )
    parser.add_argument("inputs", nargs="+", metavar="RUN_OR_OUTPUT_DIR",
                        help="an output directory of verify/bisect/matrix, or two run directories")
    parser.add_argument("-o", "--out", default="report.html", metavar="FILE",
                        help="the HTML file to write (default report.html)")
    parser.add_argument("--from-step", type=int, default=None,
                        help="two runs: compare steps >= this (e.g. a resumed run's first step)")
    parser.add_argument("--allow-config-diff", action="store_true",
                        help="two runs: compare even if their configs or recorded names differ")
    parser.add_argument("--json", action="store_true", help="print what the page says as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    for path in args.inputs:  # one output directory holds its runs (a, b, c), stages and cells two levels down
        check_input_directory(path, depth=2 if len(args.inputs) == 1 else 0)
    progress = progress_printer("report")
    progress(f"samebits report: {' '.join(args.inputs)} -> {args.out}")
    report = write_report(args.inputs, args.out, start_step=args.from_step,
                          allow_config_diff=args.allow_config_diff, progress=progress)
    if args.json:
        print_json(report.to_dict())
        return report.exit_code
    rows = [[pair.label, pair.verdict.value.upper(),
             ", ".join(f"rank {r}: step {s}" for r, (s, _) in sorted(pair.first_by_rank.items())[:4])
             + (" ..." if len(pair.first_by_rank) > 4 else "") or (pair.error.splitlines()[0] if pair.error else "-")]
            for pair in report.pairs]
    echo(f"samebits report: {'STOPPED' if report.stopped else report.verdict.value.upper()} ({report.kind})")
    if report.conclusion:
        echo(report.conclusion)  # the sentence the page leads with
    if rows:
        echo("")
        echo(table(["compared", "verdict", "first divergent step by rank"], rows))
    echo("")
    echo(f"wrote {report.out} ({len(report.sections)} sections); open it in a browser (works offline)")
    sys.stdout.flush()
    return report.exit_code
