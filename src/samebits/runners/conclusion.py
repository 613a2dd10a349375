"""The one sentence that says what a verify, bisect, matrix or diff found.

The terminal prints it under each command's headline and `samebits report` leads its page with
it, so both say the same thing in the same words.  Each function reads the typed result: the
terminal passes the one it has in memory, the page the summary on disk read back
(`ToDict.from_dict`); `conclusion` picks the function by the command the result names.  A diff
names no command and is read in its dictionary form (``DiffResult.to_dict()``).

    verify   FAIL: the resume at step 2 (A against C) diverged at step 2, rank 0 (params/w);
             what differs: step 2, rank 0: ...; the independent runs (A against B) are bit-identical.
    bisect   DIVERGED: <the bisection's own conclusion: the origin, or why it is not known>
    matrix   FAIL: single fp32: resume diverged (bisect of the resume: ...)
    diff     DIVERGED at step 3, rank 1: grads/layer2.weight
             DIVERGED at step 5, rank 0: params/fc.weight (compared from step 4, where b starts: b resumed a run)

A diff of a resumed run compares from where the resumed run starts (its ``resumed`` field);
`diff_window` reads that choice, so the sentence, the report's tables and its JSON name one window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from samebits.compare import Divergence
from samebits.runners._bisect_result import BisectResult
from samebits.runners.across import AcrossResult, LayoutCheck
from samebits.runners.matrix import MatrixResult
from samebits.runners.verify import VerifyResult
from samebits.verdicts import ToDict, Verdict

MAX_FAILURES = 3  # a matrix names this many failing cells in its sentence, then counts the rest


def conclusion(result: ToDict | Mapping) -> str:
    """The sentence for a verify, verify --across, bisect or matrix result, by the command it
    names (``summary_of``, written as a summary's ``command``); a diff's, for anything else."""
    said = {"verify": verify_conclusion, "verify --across": across_conclusion, "bisect": bisect_conclusion,
            "matrix": matrix_conclusion}.get(getattr(type(result), "summary_of", None) or "")
    return said(result) if said is not None else diff_conclusion(result)


def _verdict(verdict: Verdict | str) -> str:
    return Verdict(verdict).value.upper()


def _where(first: Divergence | Mapping) -> str:
    """A first divergence's record (phase/name), or what it says when it has no record."""
    first = first.to_dict() if isinstance(first, Divergence) else first
    if first.get("name") is not None:
        return f"{first.get('phase')}/{first.get('name')}"
    return str(first.get("detail") or "")


def verify_conclusion(result: VerifyResult) -> str:
    """Each checked guarantee that diverged (where, and the most specific thing the state census
    says differs), each that could not be decided (its first reason), those that held, and those
    not checked."""

    def label(name: str) -> str:
        if name == "resume":
            return f"the resume at step {result.resume_at} (A against C)" if result.resume_at is not None else \
                "the resume (A against C)"
        return {"independent": "the independent runs (A against B)"}.get(name, name)

    diverged, undecided, held, unchecked = [], [], [], []
    for name, check in result.checks.items():
        if check is None:
            unchecked.append(label(name))
            continue
        verdict, gap = Verdict(check.verdict), result.gaps.get(name)
        if verdict is not Verdict.INCOMPLETE and result.check_verdict(name) is Verdict.INCOMPLETE:  # by a gap
            undecided.append(f"{label(name)} could not be decided (samebits could not record "
                             + ("the state census" if not isinstance(gap, int) else "the run" if gap < 0
                                else f"from step {gap}") + ": a samebits bug, see the note)")
        elif verdict is Verdict.DIVERGED:
            first = check.first_divergence
            text = f"{label(name)} diverged at step {first and first.step}, rank {first and first.rank}" \
                f" ({_where(first or {})})"
            lines = result.explanations.get(name) or []
            if lines:
                text += f"; what differs: {lines[0]}"
            diverged.append(text)
        elif verdict is Verdict.IDENTICAL:
            held.append(label(name))
        else:
            reasons = list(check.incomplete) + list(check.notes)
            undecided.append(f"{label(name)} could not be decided" + (f" ({reasons[0]})" if reasons else ""))
    parts = diverged + undecided
    if held:
        parts.append(" and ".join(held) + ": bit-identical")
    if unchecked:
        parts.append("not checked: " + ", ".join(unchecked))
    return f"{_verdict(result.verdict)}: " + ("; ".join(parts) or "nothing was checked") + "."


def across_conclusion(result: AcrossResult) -> str:
    """`verify --across`: the layouts that diverged from the reference (where), those that could
    not be decided, those bit-identical, the resumes at other layouts (``--resume-across``),
    whether the final checkpoints hold the same state, and what the negative controls showed."""
    reference = result.layouts[0] if result.layouts else "the first layout"
    diverged, undecided, held = [], [], []
    for check in result.checks.values():
        name, verdict, first = check.layout, Verdict(check.verdict), check.first_divergence or {}
        if verdict is Verdict.DIVERGED:
            diverged.append(f"{name} diverged from {reference} at step {first.get('step')} ({_where(first)})")
        elif verdict is not Verdict.IDENTICAL:
            undecided.append(f"{name} could not be compared ({_why(check)})")
        else:
            steps = check.compared.get("steps")
            held.append(f"{name}" + (f" ({steps} steps)" if steps is not None else ""))
    parts = diverged + undecided
    if held:
        by = "global digest" if all(c.by == "global" for c in result.checks.values()) else "replicated records"
        parts.append(f"{', '.join(held)} bit-identical to {reference} by {by}")
    parts += _resume_across_parts(result, reference)
    if result.checkpoints_equal is False:
        differ = next((n for n in result.notes if "content hashes differ" in n),
                      "the final checkpoints' content hashes differ")
        held_roots = " although every step's parameters compared equal" if held and not diverged else ""
        parts.append(differ + held_roots)
    elif result.checkpoints_equal is True:
        parts.append("the final checkpoints hold the same training state (content hashes equal)")
    controls = result.controls
    if controls is None:
        parts.append(f"controls {result.controls_note or 'not run'}")
    else:
        incomplete = [c.layout for c in controls if Verdict(c.verdict) is Verdict.INCOMPLETE]
        same = [c.layout for c in controls if not c.differs and Verdict(c.verdict) is not Verdict.INCOMPLETE]
        if same:
            parts.append(f"the control did not differ for {', '.join(same)} (without the switches): the "
                         "comparison cannot tell layouts apart")
        if incomplete:
            parts.append(f"the control of {', '.join(incomplete)} could not be compared")
        if not same and not incomplete:
            parts.append(f"every control (without the switches) differed at step "
                         f"{' or '.join(sorted({str(c.first_step) for c in controls}))}")
    return f"{_verdict(result.verdict)}: {'; '.join(parts)}."


def _why(check: LayoutCheck) -> str:
    """Why a layout's check could not decide: its first reason."""
    return (check.incomplete or check.notes or ["could not be decided"])[0]


def _resume_across_parts(result: AcrossResult, reference: str) -> list[str]:
    """The resumes of ``--resume-across``: which diverged (where), could not resume (why), matched."""
    if not result.resume:
        return []
    step, last = result.resume_at, None
    parts, matched = [], []
    for check in result.resume.values():
        name, verdict, first = check.layout, Verdict(check.verdict), check.first_divergence or {}
        if verdict is Verdict.DIVERGED:
            parts.append(f"{name} resumed from {reference}'s checkpoint of step {step} diverged at step "
                         f"{first.get('step')} ({_where(first)})")
        elif verdict is not Verdict.IDENTICAL:
            why = _why(check)
            parts.append(why if why.startswith(f"{name} could not resume") else f"{name} could not resume ({why})")
        else:
            steps = check.compared.get("steps") or 0
            last = step + steps - 1 if step is not None else None
            matched.append(name)
    if matched:
        parts.append(f"{', '.join(matched)} resumed {reference}'s checkpoint of step {step} and matched it bit for "
                     f"bit to step {last}")
    return parts


def bisect_conclusion(result: BisectResult) -> str:
    """The bisection's own conclusion (the origin and its call site, or why it is not known):
    never a record of the first stage's diff, which may be a census record the origin explains."""
    said = result.conclusion or ("the runs are identical" if Verdict(result.verdict) is Verdict.IDENTICAL else
                                 "no origin was localised (see the stages)")
    return f"{_verdict(result.verdict)}: {said}"


def matrix_conclusion(result: MatrixResult) -> str:
    """Why the matrix is not PASS (its failures, each failing cell's bisection when it ran), or
    that every cell held."""
    failures, verdict = result.failures(), _verdict(result.verdict)
    if not failures:
        if verdict == "PASS":
            return f"PASS: every cell held both guarantees ({len(result.cells)} cell(s); baseline {result.baseline})."
        reasons = [f"{c.cell} {c.precision}: {c.reason}" for c in result.cells if c.reason]
        return f"{verdict}: no cell held or failed" + (f" ({'; '.join(reasons[:MAX_FAILURES])})" if reasons
                                                      else "") + "."
    parts = []
    for line in failures[:MAX_FAILURES]:
        cell = next((c for c in result.cells if line.startswith(f"{c.cell} {c.precision}")), None)
        found = (cell.bisect if cell is not None else None) or {}
        said = found.get("conclusion") or found.get("error")
        if said:
            of = " of the resume" if found.get("of") == "resume" else ""
            line += f" (bisect{of}: {said})"
        parts.append(line)
    if len(failures) > MAX_FAILURES:
        parts.append(f"and {len(failures) - MAX_FAILURES} more")
    return f"{verdict}: " + "; ".join(parts) + "."


def diff_window(result: dict) -> tuple[int, str] | None:
    """The step a rank-by-rank diff compared from by its own choice, because one run resumed
    the other (its streams start at that step), and which run that is ("a" or "b"): the diff's
    ``resumed`` (`samebits.compare.ResumedWindow`); None when it compared the window it was given."""
    resumed = result.get("resumed")
    return None if not resumed else (resumed["step"], resumed["run"])


def window_words(window: tuple[int, str] | None, start_step: int | None = None) -> str:
    """How the compared window reads in a sentence: "compared from step 4, where b starts: b
    resumed a run", "compared from step 4" (a window given), or "" (every step)."""
    if window is not None:
        step, label = window
        return f"compared from step {step}, where {label} starts: {label} resumed a run"
    return f"compared from step {start_step}" if start_step else ""


def diff_conclusion(result: dict) -> str:
    """A rank-by-rank diff (`samebits.compare.DiffResult.to_dict`): where the runs first part
    (with the window when the diff chose it, for a resumed run: the steps before it are in one
    run only and were not compared), or that they are identical (with what was compared), or
    that it could not decide."""
    verdict = result.get("verdict")
    if verdict == "diverged":
        first = result.get("first_divergence") or {}
        window = window_words(diff_window(result))
        return (f"DIVERGED at step {first.get('step')}, rank {first.get('rank')}: {_where(first)}"
                + (f" ({window})" if window else ""))
    if verdict == "identical":
        return f"IDENTICAL: bit for bit. {compared_counts(result.get('compared') or {})}"
    return ("INCOMPLETE: could not decide (no divergence found in what was compared, but not everything could "
            "be compared)")


def compared_counts(compared: dict[str, Any]) -> str:
    """What a rank-by-rank diff compared: ranks, steps, records, steps equal by their root."""
    return (f"{compared.get('ranks')} rank(s) x {compared.get('steps')} step(s), {compared.get('records', 0):,} "
            f"records compared ({compared.get('steps_identical_by_root')} step(s) equal by root)")


__all__ = ["conclusion", "verify_conclusion", "bisect_conclusion", "matrix_conclusion", "diff_conclusion",
           "diff_window", "window_words", "compared_counts"]
