"""`samebits matrix [--cells ...] [--precisions ...]`: both guarantees on every layout x precision."""

from __future__ import annotations

from samebits.cli._format import print_result, table
from samebits.cli._options import (add_out_option, add_progress_options, add_recipe_options, check_out_directory,
                                   positive_int, progress_for, rank_count, step_number)
from samebits.cli._lazy import lazy
from samebits.cli._recipe import matrix_program
from samebits.defaults import DEFAULT_MAX_WORLD_SIZE
from samebits.errors import ConfigError
from samebits.recipes.cells import ParallelDims
from samebits.recipes.commands import (DEFAULT_CELLS, DEFAULT_GLOBAL_BATCH, DEFAULT_PRECISIONS, LAYOUT_INDEPENDENT,
                                       PRECISIONS, check_precisions)

MatrixResult, run_matrix, split_list = lazy("samebits.runners.matrix", "MatrixResult", "run_matrix", "split_list")
matrix_conclusion = lazy("samebits.runners.conclusion", "matrix_conclusion")


EXAMPLES = """\
samebits matrix --cells single,dp2 --precisions fp32 --steps 4
"""


def register(sub) -> None:
    parser = sub.add_parser(
        "matrix",
        help="verify the recipe on every parallel layout x precision, and compare layouts",
        description="For every cell (parallel layout: single, dpN, fsdpN, tpN, ppN, epN, joined by '-') and "
        "precision, run A, B (repeatability) and C (resumes A's checkpoint in a fresh process), as `samebits "
        "verify` does, and compare each cell's run A with the baseline cell's (agreement: identical, or the "
        "first differing step and the largest ulp distance there; informational unless --require-agreement). "
        "Exit 0 only when every required cell ran and held and no cell failed; 1 when a cell diverged or a "
        "required cell was skipped, could not start or could not decide (with the reason); 2 could not run.",
    )
    parser.add_argument("--cells", default=",".join(DEFAULT_CELLS), metavar="CELL,...",
                        help=f"parallel layouts (default {','.join(DEFAULT_CELLS)})")
    parser.add_argument("--precisions", default=",".join(DEFAULT_PRECISIONS), metavar="P,...",
                        help=f"{', '.join(PRECISIONS)} (default {','.join(DEFAULT_PRECISIONS)})")
    parser.add_argument("--required", default=None, metavar="CELL[:P],...",
                        help="cells (or cell:precision pairs) that must run and hold (default: all)")
    parser.add_argument("--baseline", default=None, metavar="CELL",
                        help="the cell the others are compared with (default: the first)")
    parser.add_argument("--require-agreement", action="store_true",
                        help="fail unless every cell is bitwise identical to the baseline")
    parser.add_argument("--bisect-failures", action="store_true",
                        help="bisect each cell whose independent runs diverged, or whose resume diverged where they held "
                        "(samebits bisect; --resume-at for a resume)")
    add_recipe_options(parser, steps=6, nondeterministic=True)  # --set applies to every cell
    parser.add_argument("--resume-at", type=positive_int, default=None, metavar="K",
                        help="the resume step (default steps/2)")
    parser.add_argument("--global-batch", type=step_number, default=DEFAULT_GLOBAL_BATCH, metavar="N",
                        help=f"samples per step in every cell, split over its data-parallel ranks "
                             f"(default {DEFAULT_GLOBAL_BATCH}; 0: the recipe's micro-batch per rank)")
    parser.add_argument("--keep-randomness", action="store_true",
                        help="keep dropout, router jitter and the load-balancing loss (default off in every cell: "
                             f"{' '.join(LAYOUT_INDEPENDENT)}), at the cost of layouts that cannot agree")
    parser.add_argument("--max-world-size", type=rank_count, default=DEFAULT_MAX_WORLD_SIZE, metavar="N",
                        help=f"a cell with more ranks cannot start (default {DEFAULT_MAX_WORLD_SIZE})")
    add_out_option(parser, "matrix")
    add_progress_options(parser)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args) -> int:
    check(args)
    progress = progress_for(args)  # stderr, each line after the elapsed time; each run's steps live

    precisions = split_list(args.precisions, "precisions")
    matrix = matrix_program(overrides=args.overrides, nondeterministic=args.nondeterministic,
                            global_batch=args.global_batch or None, layout_independent=not args.keep_randomness)
    result = run_matrix(
        matrix, args.out, cells=split_list(args.cells, "cells"), precisions=precisions,
        required=split_list(args.required, "required") if args.required is not None else None,
        baseline=args.baseline, steps=args.steps, resume_at=args.resume_at, max_world_size=args.max_world_size,
        require_agreement=args.require_agreement, bisect_failures=args.bisect_failures, progress=progress)
    return print_result(result, args.json, render)


def check(args) -> None:
    """Refuse, before the library (and torch) is loaded, a cell, baseline or precision the recipe
    does not have, and an output folder in use: the checks `samebits.runners.matrix` makes again,
    with the recipe's own parsers (`ParallelDims.parse`, `check_precisions`, torch-free)."""
    check_precisions(_items(args.precisions))
    cells = [ParallelDims.parse(name).name for name in _items(args.cells)]
    if args.baseline and ParallelDims.parse(args.baseline).name not in cells:
        raise ConfigError(f"--baseline {ParallelDims.parse(args.baseline).name!r} is not one of the cells "
                          f"({', '.join(cells)})")
    for item in _items(args.required):
        ParallelDims.parse(item.partition(":")[0])
    check_out_directory(args.out)


def _items(text: str | None) -> list[str]:
    """The items of a comma-separated option (`samebits.runners.matrix.split_list` says what is wrong
    with an empty one)."""
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def render(result: MatrixResult) -> str:
    rows = [[c.cell, c.precision, str(c.world_size), ("yes" if c.required else "no"), c.verdict.value.upper(),
             c.check("independent"), c.check("resume"), c.agreement.short(), f"{c.seconds:.1f}",
             c.reason or _bisect_short(c.bisect) or "-"] for c in result.cells]
    lines = [f"samebits matrix: {result.verdict.value.upper()} (baseline {result.baseline}"
             + ("; agreement required)" if result.require_agreement else ")"),
             matrix_conclusion(result), "",
             table(["cell", "precision", "ranks", "required", "verdict", "repeatable", "resume",
                    f"agrees with {result.baseline}", "seconds", "why"], rows), ""]
    lines += [f"failed: {line}" for line in result.failures()]
    for c in result.cells:
        for check, explanations in (c.verify.explanations.items() if c.verify is not None else ()):
            lines += [f"{c.cell} {c.precision}, {check}: what differs (most specific first):"]
            lines += [f"  {line}" for line in explanations[:5]]
            if len(explanations) > 5:
                lines.append(f"  ... and {len(explanations) - 5} more (summary.json)")
        if c.bisect is not None:
            of = " of the resume" if c.bisect.get("of") == "resume" else ""
            lines.append(f"{c.cell} {c.precision}, bisect{of}: {c.bisect.get('conclusion') or c.bisect.get('error')}")
    lines += [f"note: {note}" for note in result.notes]
    lines.append("agreement: identical, or the first step whose global records differ and the largest ulp "
                 "distance of the global metrics there; layouts may legitimately differ in the last bits")
    lines.append(f"streams, logs and summary.json in {result.out}")
    return "\n".join(lines)


def _bisect_short(found: dict | None) -> str:
    """The table's word on a bisected cell: where its origin is (the full conclusion follows
    the table)."""
    if not found:
        return ""
    origin = found.get("origin")
    if not origin:
        return "bisect: " + ("error" if "error" in found else "not localised")
    where = [f"step {origin.get('step')}", f"rank {origin.get('rank')}", origin.get("phase"),
             origin.get("module") or None, origin.get("op")]
    return "bisect: " + ", ".join(str(part) for part in where if part)
