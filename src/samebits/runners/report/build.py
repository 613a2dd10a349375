"""`build_report`: which page an input directory gets (verify, verify --across, bisect, matrix, a
stopped command, or two runs), each built from its summary and its runs' streams.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from samebits.errors import ConfigError
from samebits.runners.bisect import BisectResult
from samebits.runners.conclusion import conclusion, diff_conclusion
from samebits.runners.report.commands import (across_certificate, across_summary, bisect_summary, matrix_summary,
                                           verify_summary)
from samebits.runners.report.evidence import (_across_verdict, _compare, _contradiction, _first_stage_pair,
                                           _later_start, _matrix_verdict, _settle, _verify_verdict)
from samebits.runners.report.page import Page, Report, _table
from samebits.runners.report.pairs import pair_sections
from samebits.runners.report.summaries import Summary, _Required, _certificate, _check_fields, _summary, _verdict
from samebits.verdicts import Verdict


MAX_PAIRS = 6  # compared pairs on one page (a matrix may hold many failing cells)


def write_report(inputs: list[str | Path], out: str | Path, *, start_step: int | None = None,
                 allow_config_diff: bool = False, progress: Callable[[str], None] | None = None) -> Report:
    """Build the page for ``inputs`` (see `build_report`) and write it to ``out``."""
    out = Path(out)
    if out.exists() and out.is_dir():
        raise ConfigError(f"-o {out} is a directory: give the path of the HTML file to write, e.g. -o report.html.")
    report = build_report(inputs, start_step=start_step, allow_config_diff=allow_config_diff, progress=progress)
    out.write_text(report.html, encoding="utf-8")
    report.out = str(out)
    return report


def build_report(inputs: list[str | Path], *, start_step: int | None = None, allow_config_diff: bool = False,
                 progress: Callable[[str], None] | None = None) -> Report:
    """The page for one output directory of `samebits verify`, `bisect` or `matrix` (it holds
    ``summary.json``), or for two run directories (compared here).  ``start_step`` and
    ``allow_config_diff`` apply to two run directories, as in `samebits diff`."""
    say = progress or (lambda message: None)
    paths = [Path(p) for p in inputs]
    if not paths or len(paths) > 2:
        raise ConfigError(f"give one output directory (of samebits verify, bisect or matrix) or two run "
                          f"directories to compare; got {len(paths)} path(s).")
    for path in paths:
        if not path.is_dir():
            raise ConfigError(f"{path}: no such directory; give a verify/bisect/matrix output directory or "
                              "two run directories.")
    if len(paths) == 2:
        pair = _compare(f"{paths[0].name or paths[0]} vs {paths[1].name or paths[1]}", paths[0], paths[1],
                        start_step, allow_config_diff, say, "[1/1]")
        page = Page("diff", f"samebits diff {paths[0]} {paths[1]}", pair.verdict)
        page.conclusion = (diff_conclusion(pair.result.to_dict()) if pair.result is not None else
                           f"INCOMPLETE: could not compare: {pair.error.splitlines()[0] if pair.error else ''}")
        pair_sections(page, pair)
        return page.finish([str(p) for p in paths], [pair])
    path = paths[0]
    if start_step is not None or allow_config_diff:
        raise ConfigError("--from-step and --allow-config-diff apply to two run directories; an output directory "
                          "is reported with the windows its command compared.")
    summary = _summary(path)
    if summary is None:
        raise ConfigError(f"{path}: neither an output directory (no summary.json) nor one of two runs. Give the "
                          "directory `samebits verify`, `bisect` or `matrix` wrote (--out), or two run directories "
                          "to compare.")
    page = {"stopped": _stopped_report, "matrix": _matrix_report, "bisect": _bisect_report,
            "verify --across": _across_report, "verify": _verify_report}.get(summary.command)
    if page is not None:
        return page(path, summary, say)
    raise ConfigError(f"{path / 'summary.json'}: not a summary of samebits verify, bisect or matrix (its 'command' is "
                      f"{summary.command!r}; samebits before 2026-12 wrote none: run the command again); give the "
                      "output directory of one of those commands.")


def _settled_page(command: str, path: Path, summary: dict, file: Path, derive) -> Page:
    """The page of a summary whose verdict is derived again from its parts (``derive``): the
    one it claims is kept only where the parts agree (`_settle`, whose notes the page shows)."""
    notes: list[str] = []
    derived, why = derive(summary, file)
    page = Page(command, f"samebits {command}: {path}",
                _settle(_verdict(summary.get("verdict"), file), derived, file, why, notes))
    page.notes.extend(notes)
    return page


def _verify_report(path: Path, found: Summary, say) -> Report:
    summary = found.data
    file = path / "summary.json"
    page = _settled_page("verify", path, summary, file, _verify_verdict)
    page.conclusion = conclusion(found.result)
    checks = summary.get("checks") or {}
    resume_at = summary.get("resume_at")
    pairs = []
    todo = [(name, check) for name, check in checks.items() if check is not None]
    for index, (name, check) in enumerate(todo, 1):
        other = {"independent": "b", "resume": "c"}.get(name)
        if other is None:
            continue
        start = resume_at if name == "resume" else None
        pair = _compare(f"{name}: a vs {other}", path / "a", path / other, start, False, say,
                        f"[{index}/{len(todo)}]", names=_verify_names(other, resume_at))
        if name == "resume" and (path / "b").is_dir():
            pair.independent = str(path / "b")
        recorded = check.get("verdict")
        if pair.result is not None and recorded != pair.verdict.value:
            pair.notes.append(f"summary.json says {recorded!r} for this check, but comparing the streams now gives "
                              f"{pair.verdict.value!r}: the streams changed after verify ran (or are damaged).")
            if page.verdict is Verdict.PASS:  # a PASS the streams no longer show is not shown
                page.verdict = Verdict.INCOMPLETE
        pairs.append(pair)
    verify_summary(page, summary, pairs)
    for pair in sorted(pairs, key=lambda p: p.verdict is Verdict.IDENTICAL):  # what failed comes first
        pair_sections(page, pair)
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _across_report(path: Path, found: Summary, say) -> Report:
    """`verify --across`: layouts of different world sizes are not compared rank by rank here, so
    the verdicts are shown as verify found them (held to their checks), then its certificate.json."""
    summary, file = found.data, path / "summary.json"
    notes: list[str] = []
    claimed = _verdict(summary.get("verdict"), file)
    derived, why = _across_verdict(summary, file)
    verdict = _settle(claimed, derived, file, why, notes)
    certificate = _certificate(path)
    if certificate is not None:
        cert_file = path / "certificate.json"
        cert_derived, cert_why = _across_verdict(certificate, cert_file)
        cert_verdict = _settle(_verdict(certificate.get("verdict"), cert_file), cert_derived, cert_file, cert_why,
                               notes)
        if cert_verdict is not verdict:
            raise _contradiction(cert_file, f"its verdict {cert_verdict.value!r} is not summary.json's "
                                            f"{verdict.value!r}")
        for name, check in (certificate.get("checks") or {}).items():
            recorded = ((summary.get("checks") or {}).get(name) or {}).get("verdict")
            if check.get("verdict") != recorded:
                raise _contradiction(cert_file, f"layout {name!r} is {check.get('verdict')!r} here but "
                                                f"{recorded!r} in summary.json")
    page = Page("verify --across", f"samebits verify --across: {path}", verdict)
    page.notes.extend(notes)
    page.conclusion = conclusion(found.result)
    across_summary(page, found.result)
    if certificate is None:
        page.notes.append(f"no certificate.json in {path}: the roots, checkpoints and reductions are not shown")
    else:
        across_certificate(page, certificate)
    page.notes.append("layouts of different world sizes are compared by global tensor, not rank by rank: no heatmap "
                      "or environment comparison is drawn for them")
    return page.finish([str(path)], [], notes=list(summary.get("notes") or []))


def _stopped_report(path: Path, found: Summary, say) -> Report:
    """A command that did not finish (`samebits.runners._launch.write_stopped`): what stopped it and
    the runs that had ended; no verdict on the runs (exit 3)."""
    summary, file = found.data, path / "summary.json"
    _check_fields(summary, {"stopped": _Required(str), "runs": [{"name": str, "command": str, "ended": str}]},
                  file, "")
    page = Page("stopped", f"samebits: {path} (stopped)", Verdict.INCOMPLETE)
    page.stopped = summary["stopped"]
    page.conclusion = f"STOPPED: {summary['stopped']}; nothing was compared."
    page.h2("Runs that had ended", "runs")
    runs = summary.get("runs") or []
    page.add(_table(["run", "exit", "ended", "seconds", "command"],
                    [[r.get("name"), r.get("exit_code"), r.get("ended"), r.get("seconds"), r.get("command")]
                     for r in runs]) if runs else "<p>none</p>")
    return page.finish([str(path)], [])


def _bisect_report(path: Path, found: Summary, say) -> Report:
    result: BisectResult = found.result
    page = Page("bisect", f"samebits bisect: {path}", result.verdict)
    page.conclusion = conclusion(result)
    bisect_summary(page, result)
    pairs = []
    first_stage = _first_stage_pair(path)
    if first_stage is not None:
        a, b = first_stage
        start = _later_start(a, b)
        pair = _compare(f"{a.parent.name}: a vs b", a, b, start, True, say, "[1/1]",
                        names=("run a", "run b (resumed)" if start else "run b"))
        pair.context = ("the first record that differs in this stage's streams: what the bisection explains, "
                        "not its conclusion (above)")
        if start:
            pair.notes.append(f"b starts at step {start} (a resumed run): compared from step {start}")
        pairs.append(pair)
        pair_sections(page, pair)
    else:
        page.notes.append("no stage run directories (NN-stage/a, NN-stage/b) were found beside summary.json: "
                          "the heatmap and curves need the streams")
    return page.finish([str(path)], pairs, notes=list(result.notes))


def _matrix_report(path: Path, found: Summary, say) -> Report:
    summary, file = found.data, path / "summary.json"
    page = _settled_page("matrix", path, summary, file, _matrix_verdict)
    page.conclusion = conclusion(found.result)
    matrix_summary(page, summary)
    pairs = []
    failing = [c for c in summary.get("cells") or [] if c.get("verdict") == Verdict.FAIL.value]
    for cell in failing[:MAX_PAIRS]:
        cell_out = Path(str(cell.get("out", "")))
        read = _summary(cell_out) if cell_out.is_dir() else None
        cell_summary = None if read is None else read.data
        if cell_summary is None:
            page.notes.append(f"cell {cell.get('cell')} {cell.get('precision')}: no verify output at {cell_out}")
            continue
        for name, other in (("independent", "b"), ("resume", "c")):
            check = (cell_summary.get("checks") or {}).get(name)
            if check is None or check.get("verdict") != Verdict.DIVERGED.value:
                continue
            start = cell_summary.get("resume_at") if name == "resume" else None
            pair = _compare(f"{cell.get('cell')} {cell.get('precision')} {name}: a vs {other}", cell_out / "a",
                            cell_out / other, start, False, say, f"[{len(pairs) + 1}]",
                            names=_verify_names(other, start))
            if name == "resume" and (cell_out / "b").is_dir():
                pair.independent = str(cell_out / "b")  # census records that differ A to B too are left out
            pairs.append(pair)
            pair_sections(page, pair)
    if len(failing) > MAX_PAIRS:
        page.notes.append(f"{len(failing) - MAX_PAIRS} more failing cell(s) not drawn (see the cells table)")
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _verify_names(other: str, resume_at: int | None) -> tuple[str, str]:
    """What the legends call verify's runs: A against B (independent) or C (resumed)."""
    if other == "c":
        return "run A", f"run C (resumed at step {resume_at})" if resume_at is not None else "run C (resumed)"
    return "run A", "run B"
