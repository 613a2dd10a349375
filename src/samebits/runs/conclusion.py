"""The one sentence that says what a verify, bisect, matrix or diff found.

The terminal prints it under each command's headline and `samebits report` leads its page with
it, so both say the same thing in the same words.  Each function reads the result's dictionary
form (``to_dict()``, which is also what ``summary.json`` holds): the terminal passes the result
it has in memory, the page the summary on disk.

    verify   FAIL: the resume at step 2 (A against C) diverged at step 2, rank 0 (params/w);
             what differs: step 2, rank 0: ...; the independent runs (A against B) are bit-identical.
    bisect   DIVERGED: <the bisection's own conclusion: the origin, or why it is not known>
    matrix   FAIL: single fp32: resume diverged (bisect of the resume: ...)
    diff     DIVERGED at step 3, rank 1: grads/layer2.weight
             DIVERGED at step 5, rank 0: params/fc.weight (compared from step 4, where b starts: b resumed a run)

A diff of a resumed run chooses its own window (its streams start later: `samebits.compare.diff`
compares from there and says so, in its ``resumed`` field); `diff_window` reads that choice, so the
sentence, the report's tables and its JSON all name the same window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_FAILURES = 3  # a matrix names this many failing cells in its sentence, then counts the rest


def command_of(summary: Mapping) -> str | None:
    """The command whose result ``summary`` is: the ``command`` it names (every summary writes
    it, `samebits.verdicts.ToDict.summary_of`), or, for a file written before that field (until
    2026-12), the one whose fields it holds: ``cells`` matrix, ``stages`` bisect, ``checks``
    with ``layouts`` or ``sizes`` verify --across, ``checks`` verify; None for none of them (a
    diff's result, which names no command)."""
    if summary.get("command") is not None:
        return str(summary["command"])
    if "cells" in summary:
        return "matrix"
    if "stages" in summary:
        return "bisect"
    if "checks" in summary:
        return "verify --across" if "layouts" in summary or "sizes" in summary else "verify"
    return None


def conclusion(summary: dict) -> str:
    """The sentence for any of the four, by the command the summary names (`command_of`); a
    `verify --across` summary written before its layouts (dp sizes only) reads as verify's."""
    command = command_of(summary)
    if command == "verify --across" and "layouts" not in summary:
        command = "verify"
    said = {"matrix": matrix_conclusion, "bisect": bisect_conclusion, "verify --across": across_conclusion,
            "verify": verify_conclusion}.get(command or "", diff_conclusion)
    return said(summary)


def _verdict(summary: dict) -> str:
    return str(summary.get("verdict") or "incomplete").upper()


def _where(first: dict) -> str:
    """A first divergence's record (phase/name), or what it says when it has no record."""
    if first.get("name") is not None:
        return f"{first.get('phase')}/{first.get('name')}"
    return str(first.get("detail") or "")


def verify_conclusion(summary: dict) -> str:
    """Each checked guarantee that diverged (where, and the most specific thing the state census
    says differs), each that could not be decided (its first reason), those that held, and those
    not checked."""
    checks = summary.get("checks") or {}
    resume_at = summary.get("resume_at")
    explanations = summary.get("explanations") or {}

    def label(name: str) -> str:
        if name == "resume":
            return f"the resume at step {resume_at} (A against C)" if resume_at is not None else \
                "the resume (A against C)"
        return {"independent": "the independent runs (A against B)"}.get(name, name)

    diverged, undecided, held, unchecked = [], [], [], []
    for name, check in checks.items():
        if check is None:
            unchecked.append(label(name))
            continue
        verdict = check.get("verdict")
        gaps = summary.get("gaps") or {}
        gap = gaps.get(name)
        first = check.get("first_divergence") or {}
        if name in gaps and (verdict == "identical" or (verdict == "diverged" and isinstance(gap, int) and not (
                isinstance(first.get("step"), int) and first["step"] < gap))):
            undecided.append(f"{label(name)} could not be decided (samebits could not record "
                             + ("the state census" if not isinstance(gap, int) else "the run" if gap < 0
                                else f"from step {gap}") + ": a samebits bug, see the note)")
            continue
        if verdict == "diverged":
            text = f"{label(name)} diverged at step {first.get('step')}, rank {first.get('rank')} ({_where(first)})"
            lines = explanations.get(name) or []
            if lines:
                text += f"; what differs: {lines[0]}"
            diverged.append(text)
        elif verdict == "identical":
            held.append(label(name))
        else:
            reasons = list(check.get("incomplete") or []) + list(check.get("notes") or [])
            undecided.append(f"{label(name)} could not be decided" + (f" ({reasons[0]})" if reasons else ""))
    parts = diverged + undecided
    if held:
        parts.append(" and ".join(held) + ": bit-identical")
    if unchecked:
        parts.append("not checked: " + ", ".join(unchecked))
    return f"{_verdict(summary)}: " + ("; ".join(parts) or "nothing was checked") + "."


def across_conclusion(summary: dict) -> str:
    """`verify --across`: the layouts that diverged from the reference (where), those that could
    not be decided, those bit-identical, the resumes at other layouts (``--resume-across``),
    whether the final checkpoints hold the same state, and what the negative controls showed."""
    reference = summary.get("reference") or "the first layout"
    diverged, undecided, held = [], [], []
    for name, check in (summary.get("checks") or {}).items():
        verdict = str(check.get("verdict"))
        first = check.get("first_divergence") or {}
        if verdict == "diverged":
            diverged.append(f"{name} diverged from {reference} at step {first.get('step')} ({_where(first)})")
        elif verdict != "identical":
            why = (check.get("incomplete") or check.get("notes") or ["could not be decided"])[0]
            undecided.append(f"{name} could not be compared ({why})")
        else:
            steps = (check.get("compared") or {}).get("steps")
            held.append(f"{name}" + (f" ({steps} steps)" if steps is not None else ""))
    parts = diverged + undecided
    if held:
        parts.append(f"{', '.join(held)} bit-identical to {reference} by "
                     f"{'global digest' if all(c.get('by') == 'global' for c in (summary.get('checks') or {}).values()) else 'replicated records'}")
    parts += _resume_across_parts(summary, reference)
    if summary.get("checkpoints_equal") is False:
        differ = next((n for n in summary.get("notes") or [] if "content hashes differ" in n),
                      "the final checkpoints' content hashes differ")
        held_roots = " although every step's parameters compared equal" if held and not diverged else ""
        parts.append(differ + held_roots)
    elif summary.get("checkpoints_equal") is True:
        parts.append("the final checkpoints hold the same training state (content hashes equal)")
    controls = summary.get("controls")
    if controls is None:
        parts.append(f"controls {summary.get('controls_note') or 'not run'}")
    else:
        same = [c.get("layout") for c in controls if not c.get("differs") and c.get("verdict") != "incomplete"]
        undecided_controls = [c.get("layout") for c in controls if c.get("verdict") == "incomplete"]
        if same:
            parts.append(f"the control did not differ for {', '.join(map(str, same))} (without the switches): the "
                         "comparison cannot tell layouts apart")
        if undecided_controls:
            parts.append(f"the control of {', '.join(map(str, undecided_controls))} could not be compared")
        if not same and not undecided_controls:
            parts.append(f"every control (without the switches) differed at step "
                         f"{' or '.join(sorted({str(c.get('first_step')) for c in controls}))}")
    return f"{_verdict(summary)}: {'; '.join(parts)}."


def _resume_across_parts(summary: dict, reference: str) -> list[str]:
    """The resumes of ``--resume-across``: which diverged (where), could not resume (why), matched."""
    resumed = summary.get("resume_across")
    if not resumed:
        return []
    step, last = resumed.get("step"), None
    parts, matched = [], []
    for name, check in (resumed.get("checks") or {}).items():
        verdict = str(check.get("verdict"))
        first = check.get("first_divergence") or {}
        if verdict == "diverged":
            parts.append(f"{name} resumed from {reference}'s checkpoint of step {step} diverged at step "
                         f"{first.get('step')} ({_where(first)})")
        elif verdict != "identical":
            why = (check.get("incomplete") or check.get("notes") or ["could not be decided"])[0]
            parts.append(why if why.startswith(f"{name} could not resume") else f"{name} could not resume ({why})")
        else:
            steps = (check.get("compared") or {}).get("steps") or 0
            last = step + steps - 1 if step is not None else None
            matched.append(name)
    if matched:
        parts.append(f"{', '.join(matched)} resumed {reference}'s checkpoint of step {step} and matched it bit for "
                     f"bit to step {last}")
    return parts


def bisect_conclusion(summary: dict) -> str:
    """The bisection's own conclusion (the origin and its call site, or why it is not known):
    never a record of the first stage's diff, which may be a census record the origin explains."""
    said = summary.get("conclusion") or ""
    if not said:
        said = "the runs are identical" if summary.get("verdict") == "identical" else \
            "no origin was localised (see the stages)"
    return f"{_verdict(summary)}: {said}"


def matrix_conclusion(summary: dict) -> str:
    """Why the matrix is not PASS (its failures, each failing cell's bisection when it ran), or
    that every cell held."""
    cells = summary.get("cells") or []
    failures = list(summary.get("failures") or [])
    verdict = _verdict(summary)
    if not failures:
        if verdict == "PASS":
            return (f"PASS: every cell held both guarantees ({len(cells)} cell(s); baseline "
                    f"{summary.get('baseline')}).")
        reasons = [f"{c.get('cell')} {c.get('precision')}: {c.get('reason')}" for c in cells if c.get("reason")]
        return f"{verdict}: no cell held or failed" + (f" ({'; '.join(reasons[:MAX_FAILURES])})" if reasons
                                                      else "") + "."
    parts = []
    for line in failures[:MAX_FAILURES]:
        cell = next((c for c in cells if line.startswith(f"{c.get('cell')} {c.get('precision')}")), None)
        found = (cell or {}).get("bisect") or {}
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


__all__ = ["command_of", "conclusion", "verify_conclusion", "bisect_conclusion", "matrix_conclusion", "diff_conclusion",
           "diff_window", "window_words", "compared_counts"]
