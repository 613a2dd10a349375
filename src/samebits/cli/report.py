"""`samebits report OUTPUT_DIR | RUN_A RUN_B -o report.html`: one self-contained HTML page."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from samebits.cli._format import echo, print_json, progress_printer, table
from samebits.cli._options import check_input_directory, check_input_file
from samebits.cli._lazy import lazy

write_report = lazy("samebits.runners.report", "write_report")
MAX_STATE_LINES = 4  # census lines printed under the table
_STREAM = re.compile(r"^rank-\d{5,}\.sbs$")  # a rank's stream (samebits.stream.reader's name)


EXAMPLES = """\
samebits report samebits-out/verify-TIME       # the output folder of verify, bisect, matrix
samebits report runs/a runs/b -o report.html
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "report",
        help="write one self-contained HTML page of a verify, bisect, matrix or diff",
        description="Write one HTML file (no network, no scripts: open it anywhere) that leads with the "
                    "conclusion the command printed, then the verdicts, the training state that differs at each step "
                    "start (the state census: for a resume, which of A's steps each state of C holds), the growth "
                    "of the difference in ulps per step (log scale), the metric curves of both runs (loss, grad "
                    "norm, lr; a solid, b dashed), a heatmap of where the runs differ (record groups or ranks x "
                    "steps), the records that differ grouped by module, step by step, the origin of a bisection "
                    "and the difference between the runs' environments. A resumed run is compared from its "
                    "first step, and every part says so. Give the output directory of samebits verify, bisect or "
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


def check_output_directory(path: str | os.PathLike, depth: int = 2) -> None:
    """Refuse, before torch loads, an output directory that cannot be read: `check_input_directory`
    on it and on each folder under it that holds streams (its runs a, b, c, a stage's or a
    cell's), ``depth`` levels down; a folder without streams (verify's work/, where the
    program wrote its checkpoints) is the program's own, never refused."""
    path = Path(path)
    if not path.is_dir():
        check_input_directory(path, depth=depth)  # says what is wrong: missing, or not a directory
        return
    try:
        entries = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        return  # the reader says why, in its own words
    if any(_STREAM.match(entry.name) for entry in entries):  # a run: its streams and JSON files checked
        check_input_directory(path, depth=0)
    for entry in entries:
        if entry.name.endswith(".json"):
            check_input_file(path / entry.name, "a JSON file, as samebits wrote it")
        elif depth > 0 and entry.is_dir(follow_symlinks=False):
            check_output_directory(path / entry.name, depth - 1)


def run(args) -> int:
    # one output directory holds its runs (a, b, c), stages and cells two levels down
    check = check_output_directory if len(args.inputs) == 1 else check_input_directory
    for path in args.inputs:
        check(path)
    progress = progress_printer()
    progress(f"samebits report: {' '.join(args.inputs)} -> {args.out}")
    report = write_report(args.inputs, args.out, start_step=args.from_step,
                          allow_config_diff=args.allow_config_diff, progress=progress)
    if args.json:
        print_json(report.to_dict())
        return report.exit_code
    # each row says what its pair's sentence says (`Pair.conclusion`): the same window, the same first step
    rows = [[pair.label, pair.verdict.value.upper(), f"step {pair.start_step}" if pair.start_step else "every step",
             ", ".join(f"rank {r}: step {s}" for r, (s, _) in sorted(pair.first_by_rank.items())[:4])
             + (" ..." if len(pair.first_by_rank) > 4 else "") or (pair.error.splitlines()[0] if pair.error else "-")]
            for pair in report.pairs]
    echo(f"samebits report: {'STOPPED' if report.stopped else report.verdict.value.upper()} ({report.kind})")
    if report.conclusion:
        echo(report.conclusion)  # the sentence the page leads with
    if rows:
        echo("")
        echo(table(["compared", "verdict", "compared from", "first divergent step by rank"], rows))
        for pair in report.pairs:
            if pair.window and pair.start_step is not None and pair.window != f"compared from step {pair.start_step}":
                echo(f"{pair.label}: {pair.window}")  # why that window (a resumed run), as the sentence says
        said = [(pair.label, line) for pair in report.pairs for line in pair.census_summary.get("says", [])]
        if said:  # the state that differs, as the page draws it (its first lines; all of them on the page)
            echo("")
            echo("the training state at step start (the page draws it):")
            for label, line in said[:MAX_STATE_LINES]:
                echo(f"  {label}: {line}")
            if len(said) > MAX_STATE_LINES:
                echo(f"  ... and {len(said) - MAX_STATE_LINES} more (the page lists them all)")
    echo("")
    echo(f"wrote {report.out} ({len(report.sections)} sections); open it in a browser (works offline)")
    sys.stdout.flush()
    return report.exit_code
