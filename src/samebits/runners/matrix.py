"""`samebits matrix`: the two guarantees on every parallel layout and precision of the recipe.

Every (cell, precision) is a `verify` (A, B, and C resumed), and its run A is compared with the
baseline cell's (agreement: reported, deciding the verdict only with ``require_agreement``).
The verdict rules are docs/matrix.md's ("The verdict").  The engine knows no program:
`MatrixProgram` reads a cell name and gives the program's commands for a cell and precision.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from samebits.compare import diff
from samebits.defaults import DEFAULT_MAX_WORLD_SIZE
from samebits.errors import ConfigError, SamebitsError, StreamError
from samebits.runners._launch import RunFailed
from samebits.runners.bisect import bisect
from samebits.runners.commands import RecipeRefused, prepare_out_dir, write_summary
from samebits.runners.distance import ulp_distance
from samebits.runners.progress import indented
from samebits.runners.program import Program
from samebits.runners.verify import VerifyResult, verify
from samebits.stream import open_run
from samebits.verdicts import ToDict, Verdict, milliseconds, serialised


class Layout(Protocol):
    """A cell's parallel layout, as the engine reads it (the recipe's `ParallelDims`)."""

    @property
    def name(self) -> str: ...  # the canonical cell name

    @property
    def world_size(self) -> int: ...  # ranks of one run


@dataclass(frozen=True)
class MatrixProgram:
    """What the matrix needs of the program it verifies on every cell (the command line
    builds the reference recipe's from `samebits.recipes.commands`)."""

    parse_cell: Callable[[str], Layout]  # a cell name -> its layout (ConfigError: a bad name)
    # (cell, precision, steps) -> the cell's commands; a ConfigError: the cell cannot start
    program: Callable[[Layout, str, int], Program]
    metrics: tuple[str, ...] = ()  # the program's metrics that are global (equal on every rank), for agreement
    notes: tuple[str, ...] = ()  # what every cell runs with, for the result


def split_list(text: str | None, what: str) -> list[str]:
    """``"a,b, c"`` -> ["a", "b", "c"] (in order, without repeats)."""
    items = list(dict.fromkeys(part.strip() for part in (text or "").split(",") if part.strip()))
    if text is not None and not items:
        raise ConfigError(f"--{what} {text!r}: give a comma-separated list")
    return items


@dataclass
class Agreement(ToDict):
    """A cell's run A against the baseline cell's run A (same precision)."""

    status: str  # "identical" | "differs" | "not compared" | "baseline"
    by: str = ""  # what was compared
    first_step: int | None = None
    max_ulp: int | None = None  # largest ulp distance among the global metrics at first_step
    detail: str = ""

    def short(self) -> str:
        if self.status == "differs":
            ulp = f", {self.max_ulp} ulp" if self.max_ulp is not None else ""
            return f"step {self.first_step}{ulp}"
        return {"not compared": "-"}.get(self.status, self.status)


@dataclass
class CellResult(ToDict):
    """One (cell, precision): its verify result, or why it did not run."""

    dict_keys = ("cell", "precision", "world_size", "required", "verdict", "repeatable", "resume", "agreement",
                 "seconds", "reason", "out", "explanations", "bisect")

    cell: str
    precision: str
    world_size: int
    required: bool
    out: str
    verify: VerifyResult | None = field(default=None, metadata=serialised(skip=True))  # its checks, below
    reason: str = ""  # why it did not start, or crashed
    agreement: Agreement = field(default_factory=lambda: Agreement("not compared"))
    seconds: float = field(default=0.0, metadata=serialised(convert=milliseconds))
    bisect: dict | None = None
    # what a summary read back says of the cell's checks (its verify result is in the cell's own
    # summary.json): verdict, repeatable, resume, explanations; empty for a cell run here
    written: dict = field(default_factory=dict, metadata=serialised(skip=True, read=lambda data: {
        key: data[key] for key in ("verdict", "repeatable", "resume", "explanations") if key in data}))

    @property
    def started(self) -> bool:
        return self.verify is not None

    @property
    def verdict(self) -> Verdict:
        if self.verify is None and "verdict" in self.written:
            return Verdict(self.written["verdict"])
        return self.verify.verdict if self.verify is not None else Verdict.INCOMPLETE

    def check(self, name: str) -> str:
        """"yes" (identical), "no" (diverged), "?" (undecided) or "-" (not run)."""
        if self.verify is None:
            return self.written.get({"independent": "repeatable"}.get(name, name), "-")
        result = self.verify.checks.get(name)
        if result is None:
            return "-"
        return {Verdict.IDENTICAL: "yes", Verdict.DIVERGED: "no"}.get(Verdict(result.verdict), "?")

    def dict_extras(self) -> dict:
        explanations = self.verify.explanations if self.verify is not None else self.written.get("explanations", {})
        return {"verdict": self.verdict, "repeatable": self.check("independent"), "resume": self.check("resume"),
                "explanations": explanations}


@dataclass
class MatrixResult(ToDict):
    summary_of = "matrix"  # its summary.json names the command that wrote it

    dict_keys = ("verdict", "exit_code", "out", "baseline", "require_agreement", "failures", "cells", "notes")

    out: str
    baseline: str
    cells: list[CellResult]
    require_agreement: bool = False
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        """Why the matrix is not PASS: one line per cell that failed or required one that did not hold."""
        lines = []
        for c in self.cells:
            where = f"{c.cell} {c.precision}"
            if c.verdict is Verdict.FAIL:
                lines.append(f"{where}: " + ", ".join(f"{name} diverged" for name in ("independent", "resume")
                                                      if c.check(name) == "no"))
            elif c.required and c.verdict is not Verdict.PASS:
                lines.append(f"{where} (required): " + (c.reason or "a check could not decide"))
            elif self.require_agreement and c.agreement.status not in ("identical", "baseline"):
                lines.append(f"{where}: does not agree with the baseline ({c.agreement.short()}; "
                             f"{c.agreement.detail or c.agreement.status})")
        return lines

    @property
    def verdict(self) -> Verdict:
        if not any(c.verdict is Verdict.PASS for c in self.cells) and not self.failures():
            return Verdict.INCOMPLETE  # nothing held and nothing failed: nothing was proven
        return Verdict.FAIL if self.failures() else Verdict.PASS

    def dict_extras(self) -> dict:
        return {"verdict": self.verdict, "exit_code": self.verdict.exit_code, "failures": self.failures()}


def run_matrix(
    matrix: MatrixProgram,
    out=None,
    *,
    cells: list[str],
    precisions: list[str],
    required: list[str] | None = None,
    baseline: str | None = None,
    steps: int = 6,
    resume_at: int | None = None,
    max_world_size: int = DEFAULT_MAX_WORLD_SIZE,
    require_agreement: bool = False,
    bisect_failures: bool = False,
    progress: Callable[[str], None] | None = None,
) -> MatrixResult:
    """Verify ``matrix``'s program on every cell x precision and compare each with the ``baseline``
    cell (default: the first).  ``required``: the cells (``tp2``) or cell:precision pairs that must
    run and hold (None: all).  ``bisect_failures``: bisect each cell whose independent runs, or
    else whose resume, diverged."""
    say = progress or (lambda message: None)
    parsed = [matrix.parse_cell(name) for name in cells]
    if not parsed or not precisions:
        raise ConfigError("the matrix needs at least one cell and one precision")
    names = [cell.name for cell in parsed]
    baseline = matrix.parse_cell(baseline).name if baseline else names[0]
    if baseline not in names:
        raise ConfigError(f"--baseline {baseline!r} is not one of the cells ({', '.join(names)})")
    wanted = _required(required, names, precisions, matrix.parse_cell)
    out = prepare_out_dir(out, "matrix")
    result = MatrixResult(str(out), baseline, [], require_agreement, notes=list(matrix.notes))
    order = sorted(parsed, key=lambda cell: cell.name != baseline)  # the baseline runs first
    total = len(order) * len(precisions)
    for precision in precisions:
        for cell in order:
            index = len(result.cells) + 1
            say(f"[{index}/{total}] cell {cell.name} ({cell.world_size} rank(s)), precision {precision}")
            cell_result = CellResult(cell.name, precision, cell.world_size,
                                     (cell.name, precision) in wanted, str(out / f"{cell.name}-{precision}"))
            result.cells.append(cell_result)
            _run_cell(cell_result, cell, precision, matrix, steps=steps, resume_at=resume_at,
                      max_world_size=max_world_size, say=say)
            say(f"      {cell_result.verdict.value}" + (f": {cell_result.reason}" if cell_result.reason else "")
                + f" ({cell_result.seconds:.1f} s)")
    by_key = {(c.cell, c.precision): c for c in result.cells}
    for c in result.cells:
        c.agreement = _agreement(c, by_key.get((baseline, c.precision)), matrix.metrics)
    if bisect_failures:
        for c in result.cells:
            # Independent runs that differ are bisected first (a resume cannot hold without them);
            # a cell whose runs repeat but whose resume differs is bisected on the resume.
            resume = c.check("independent") == "yes" and c.check("resume") == "no"
            if c.check("independent") == "no" or resume:
                say(f"bisecting {c.cell} {c.precision}{' (its resume)' if resume else ''} ...")
                c.bisect = _bisect_cell(c, matrix, steps, say, resume_at=c.verify.resume_at if resume else None)
    write_summary(out, result)
    return result


def _required(required: list[str] | None, names: list[str], precisions: list[str],
              parse_cell: Callable[[str], Layout]) -> set[tuple[str, str]]:
    if required is None:
        return {(n, p) for n in names for p in precisions}
    wanted = set()
    for item in required:
        cell_text, _, precision = item.partition(":")
        cell = parse_cell(cell_text).name
        if cell not in names or (precision and precision not in precisions):
            # A required cell that is not in the matrix can never run: it is refused up front.
            raise ConfigError(f"--required {item!r} is not in the matrix (cells {', '.join(names)}; precisions "
                              f"{', '.join(precisions)}); add it to --cells/--precisions")
        wanted |= {(cell, p) for p in ([precision] if precision else precisions)}
    return wanted


def _run_cell(c: CellResult, cell: Layout, precision: str, matrix: MatrixProgram, *, steps: int,
              resume_at: int | None, max_world_size: int, say: Callable[[str], None]) -> None:
    if cell.world_size > max_world_size:
        c.reason = (f"cannot start: needs {cell.world_size} ranks, more than this matrix allows "
                    f"({max_world_size}; raise --max-world-size)")
        return
    try:
        program = matrix.program(cell, precision, steps)
    except ConfigError as err:  # e.g. a global batch that does not split over the cell's ranks
        c.reason = f"cannot start: {err}"
        return
    start = time.perf_counter()
    try:
        c.verify = verify(program, c.out, resume_at=resume_at, progress=indented(say, "      "))
    except RunFailed as err:
        stage = "cannot start" if err.label == "A" else f"run {err.label} crashed"
        c.reason = f"{stage}: {err.reason}"
    except RecipeRefused as err:  # the recipe's own check, before any run of the cell
        c.reason = f"cannot start: {err.said}"
    except StreamError as err:
        c.reason = f"a stream could not be read: {err}"
    except SamebitsError as err:  # e.g. runs that record different names: no comparison, no verdict
        c.reason = "could not compare: " + " ".join(str(err).split())[:300]
    c.seconds = time.perf_counter() - start
    if c.verify is not None and c.verify.verdict is Verdict.INCOMPLETE:
        notes = [note for check in c.verify.checks.values() if check is not None
                 for note in (check.incomplete or check.notes)]
        c.reason = "could not decide: " + ("; ".join(notes[:2]) or "no step compared")


def _agreement(c: CellResult, base: CellResult | None, metrics: tuple[str, ...]) -> Agreement:
    """Run A of cell ``c`` against run A of the baseline cell (same precision)."""
    if base is None or base is c:
        return Agreement("baseline" if base is c else "not compared")
    if not (c.started and base.started):
        return Agreement("not compared", detail="the cell or the baseline did not run")
    a, b = Path(base.out) / "a", Path(c.out) / "a"
    try:
        values_a, values_b = _global_metrics(a, metrics), _global_metrics(b, metrics)
        by_metrics = _metric_agreement(values_a, values_b, metrics)
        found = diff(a, b, by="global")  # every full tensor by its global identity, any layouts
    except SamebitsError as err:
        return Agreement("not compared", detail=f"could not compare: {err}")
    if Verdict(found.verdict) is Verdict.INCOMPLETE:
        by_metrics.detail = "global digests: " + ("; ".join(found.incomplete[:1]) or "not recorded") + \
            (f"; {by_metrics.detail}" if by_metrics.detail else "")
        return by_metrics
    if found.identical:
        return Agreement("identical", by="global tensor digests")
    step = found.first_step
    ulp = _max_ulp(values_a[step], values_b[step]) if step in values_a and step in values_b else None
    names = [t.name for t in found.differing_at_first_step][:3]
    return Agreement("differs", by="global tensor digests", first_step=step, max_ulp=ulp,
                     detail="first differing: " + ", ".join(names)
                     + (f"; ulp of {'/'.join(metrics)}" if ulp is not None else ""))


def _metric_agreement(values_a: dict, values_b: dict, metrics: tuple[str, ...]) -> Agreement:
    """Compare rank 0's global metrics (`_global_metrics`), step by step."""
    common = sorted(set(values_a) & set(values_b))
    if not common:
        return Agreement("not compared", by="global metrics", detail="no common step with global metrics")
    for step in common:
        ulp = _max_ulp(values_a[step], values_b[step])
        if ulp is None:
            return Agreement("not compared", by="global metrics", detail=f"step {step}: metrics not comparable")
        if ulp:
            return Agreement("differs", by=f"global metrics ({', '.join(metrics)})", first_step=step,
                             max_ulp=ulp)
    detail = "" if len(values_a) == len(values_b) == len(common) else "steps differ between the runs"
    return Agreement("identical" if not detail else "not compared",
                     by=f"global metrics ({', '.join(metrics)})", detail=detail)


def _global_metrics(path: Path, metrics: tuple[str, ...]) -> dict[int, dict[str, tuple[str, bytes]]]:
    """Rank 0's global metrics per step: {step: {name: (dtype, raw bits)}}."""
    run = open_run(path)
    found = {}
    for block in run.steps(run.ranks[0]):
        found[block.step] = {r.name: (r.dtype, r.raw) for r in block.records()
                             if r.kind == "metric" and r.name in metrics and r.raw is not None}
    return found


def _max_ulp(a: dict[str, tuple[str, bytes]], b: dict[str, tuple[str, bytes]]) -> int | None:
    """The largest distance in units in the last place between same-named float metrics."""
    if set(a) != set(b):
        return None
    worst = 0
    for name, (dtype, raw) in a.items():
        other_dtype, other_raw = b[name]
        ulp = ulp_distance(dtype, raw, other_raw) if dtype == other_dtype else None
        if ulp is None:
            return None
        worst = max(worst, ulp)
    return worst


def _bisect_cell(c: CellResult, matrix: MatrixProgram, steps: int, say: Callable[[str], None],
                 resume_at: int | None = None) -> dict:
    """Bisect the cell's independent runs (the first 4 steps), or with ``resume_at`` its resume, on
    the cell's own program."""
    try:
        program = matrix.program(matrix.parse_cell(c.cell), c.precision, min(steps, 4) if resume_at is None else steps)
        found = bisect(out=Path(c.out) / "bisect", program=program, resume_at=resume_at,
                       progress=indented(say, "      "))
    except SamebitsError as err:
        return {"error": str(err).splitlines()[0]}
    return {"of": "resume" if resume_at is not None else "independent",
            "conclusion": found.conclusion, "verdict": str(found.verdict), "out": found.out,
            "origin": None if found.origin is None else found.origin.to_dict()}


__all__ = ["run_matrix", "MatrixProgram", "Layout", "MatrixResult", "CellResult", "Agreement", "split_list",
           "DEFAULT_MAX_WORLD_SIZE"]
