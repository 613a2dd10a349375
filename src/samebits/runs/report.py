"""`samebits report`: one self-contained HTML page of what a verify, bisect, matrix or diff found.

The page is built from what is on disk, never from memory of a run: the summary a command
wrote (``summary.json`` of `samebits verify`, `bisect` or `matrix`) and the streams of its runs,
which are compared again here with `samebits.compare` (every frame checked, every root
recomputed), so the page shows evidence it re-derived rather than copied.  Two run directories
are compared directly.

What the page holds, per compared pair of runs: the verdict; a ranks x steps heatmap of the
first divergence (each rank's own first divergent step, from `divergent_steps`, which walks
every rank to its end); which records differ at each step after the first divergence (metrics
with their distance in ulps and relative difference, exact from the recorded bits; tensors
are digests only, and the page says so instead of inventing a magnitude); the metric curves of
both runs with each step marked bit-identical or not; the origin of a bisection with its call
site and element detail (from the bisection's own element dumps); the difference between the
runs' recorded environments and configs.

One file, no network: inline CSS, charts as inline SVG generated here, no script at all, and a
Content-Security-Policy that forbids scripts and remote loads.  Every name and value passes
through `_esc` (HTML-escaped, control characters shown as ``\\xNN``): tensor names, config values
and paths come from files and runs, and a name like ``<img src=x onerror=...>`` must stay text.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import stat
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from samebits.compare import DiffResult, diff, divergent_steps
from samebits.errors import ConfigError, IncomparableRunsError, StreamError
from samebits.runs.distance import float_value, metric_distance
from samebits.stream import Record, open_run
from samebits.verdicts import ToDict, Verdict

MAX_RANKS = 64  # heatmap rows; a larger world shows its first ranks and says how many were left out
MAX_STEPS = 120  # heatmap and curve columns
MAX_TENSOR_ROWS = 40  # per-tensor table rows (records that differ at some step)
MAX_TENSOR_STEPS = 24  # per-tensor table columns, from the first divergent step on
MAX_PAIRS = 6  # compared pairs on one page (a matrix may hold many failing cells)

_OWN_VARIABLES = ("env.SAMEBITS_", "env.TORCHELASTIC_")  # set per run by samebits / torchrun, as in diff's notes
# What `_esc` writes visibly (as the terminal output does, `samebits.cli._format.escape`): C0 and
# C1 controls (Cc), format characters (Cf: bidi marks, embeddings, overrides and isolates such
# as U+061C, U+202E, U+2066-9; zero-width and tag characters), line and paragraph separators
# (Zl, Zp) and lone surrogates (Cs: the bytes of a non-UTF-8 path, which UTF-8 cannot encode).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
_CANDIDATES = re.compile("[^\x20-\x7e]")  # `_visible` keeps the safe ones


def _visible(match: re.Match) -> str:
    char = match.group()
    code = ord(char)
    if code < 0x20 or 0x7f <= code <= 0x9f:
        return f"\\x{code:02x}"
    if 0xdc80 <= code <= 0xdcff:  # a byte that was not UTF-8 (surrogateescape): shown as that byte
        return f"\\x{code - 0xdc00:02x}"
    if unicodedata.category(char) in _UNSAFE_CATEGORIES:
        return f"\\u{code:04x}" if code <= 0xffff else f"\\U{code:08x}"
    return char


def _esc(value: Any) -> str:
    """Text for the page: control, format (bidi) and separator characters and the bytes of a
    non-UTF-8 path written as visible escapes (as the terminal output does), then
    HTML-escaped, quotes included (safe in attributes too)."""
    text = value if isinstance(value, str) else str(value)
    return html.escape(_CANDIDATES.sub(_visible, text), quote=True)


@dataclass
class Pair:
    """Two runs compared for the page: the diff, each rank's own first divergent step, and
    the evidence read from the streams for the heatmap, the per-tensor table and the curves."""

    label: str
    a: str
    b: str
    start_step: int | None = None
    result: DiffResult | None = None
    error: str = ""  # why the runs could not be compared (then result is None)
    first_by_rank: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # rank -> (step, missing side)
    steps_a: dict[int, list[int]] = field(default_factory=dict)  # rank -> recorded steps
    steps_b: dict[int, list[int]] = field(default_factory=dict)
    headers: tuple[dict, dict] = ({}, {})
    num_ranks: int = 0  # recorded ranks (the heatmap draws the first MAX_RANKS)
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        return self.result.verdict if self.result is not None else Verdict.INCOMPLETE


@dataclass
class Report(ToDict):
    """The page and what it says: ``kind`` (verify, bisect, matrix, diff), the overall
    ``verdict`` (as the command that produced the inputs decided it, or the diff's), the
    section headings, the HTML text."""

    kind: str
    inputs: list[str]
    verdict: Verdict
    sections: list[str]
    html: str
    pairs: list[Pair]
    notes: list[str] = field(default_factory=list)
    out: str = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind, "verdict": self.verdict.value, "exit_code": self.verdict.exit_code,
                "inputs": self.inputs, "out": self.out, "sections": self.sections,
                "pairs": [{"label": p.label, "a": p.a, "b": p.b, "start_step": p.start_step,
                           "verdict": p.verdict.value, "error": p.error,
                           "first_divergent_step_by_rank": {str(r): s for r, (s, _) in sorted(p.first_by_rank.items())}}
                          for p in self.pairs],
                "notes": self.notes}


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
        page = _Page("diff", f"samebits diff {paths[0]} {paths[1]}", pair.verdict)
        page.pair_sections(pair)
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
    if "cells" in summary:
        return _matrix_report(path, summary, say)
    if "stages" in summary:
        return _bisect_report(path, summary, say)
    if "checks" in summary and "sizes" in summary:
        return _across_report(path, summary)
    if "checks" in summary:
        return _verify_report(path, summary, say)
    raise ConfigError(f"{path / 'summary.json'}: not a summary of samebits verify, bisect or matrix (no 'checks', "
                      "'stages' or 'cells'); give the output directory of one of those commands.")


def _summary(path: Path) -> dict | None:
    """The ``summary.json`` in ``path``, checked field by field (`_SUMMARY`): None when there is
    none; `ConfigError` naming the file and the field when it is not a regular file, not JSON,
    or a field has the wrong type (a page is never built from a summary it would misread)."""
    file = path / "summary.json"
    try:
        # O_NONBLOCK: a FIFO in place of the summary must not block the open
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ConfigError(f"{file}: cannot be read ({err.strerror or err}).") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "something else"
        raise ConfigError(f"{file}: {kind}, not a regular file; expected the summary.json a samebits command wrote.")
    with os.fdopen(fd, "rb") as handle:
        try:
            raw = handle.read()
        except OSError as err:
            raise ConfigError(f"{file}: cannot be read ({err.strerror or err}).") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ConfigError(f"{file}: cannot be read as JSON ({reason}); was the command interrupted while writing "
                          "it? Re-run the command, or report two of its run directories instead.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: not a samebits summary (a JSON object was expected, found {_json_type(data)}).")
    kind = "matrix" if "cells" in data else "bisect" if "stages" in data else "verify" if "checks" in data else None
    if kind is not None:  # (an object of none of them is refused by `build_report`, with what it expected)
        _check_fields(data, _SUMMARY[kind], file, "")
    return data


# What the page reads of each summary, by type: a dict spec lists the fields it may read (each
# optional: absent or null is an empty value), `_Each` a mapping's values (``null``: a value may
# be null), `[spec]` a list's items, `_Required` a field that must be present, and a type a leaf;
# anything not listed is shown as text, whatever it holds.
class _Each:
    def __init__(self, spec, null: bool = False):
        self.spec, self.null = spec, null


class _Required:
    def __init__(self, spec):
        self.spec = spec


_CHECK = {"verdict": str, "first_divergence": dict, "compared": dict, "notes": list}
_SUMMARY = {
    "verify": {"verdict": _Required(str), "checks": _Each(_CHECK, null=True), "resume_at": int, "runs": [dict],
               "explanations": _Each(list), "notes": list, "sizes": list},
    "bisect": {"verdict": _Required(str), "stages": [{"runs_s": dict}], "control_flow": dict,
               "origin": {"elements": {"values": [dict], "dumps": list}, "state_differs": list, "params": list,
                          "ranks": list},
               "notes": list},
    "matrix": {"verdict": _Required(str), "cells": [{"agreement": dict, "out": str}], "failures": list,
               "notes": list},
}


def _check_fields(value: Any, spec: Any, file: Path, where: str) -> None:
    if isinstance(spec, _Required):
        spec = spec.spec
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise _wrong_type(file, where, "an object", value)
        for key, inner in spec.items():
            at = f"{where}.{key}" if where else key
            if key not in value:
                if isinstance(inner, _Required):
                    raise ConfigError(f"{file}: field {at!r} is missing; is the file from this samebits version?")
                continue
            if value[key] is not None:
                _check_fields(value[key], inner, file, at)
        return
    if isinstance(spec, _Each):
        if not isinstance(value, dict):
            raise _wrong_type(file, where, "an object", value)
        for key, item in value.items():
            if item is not None or not spec.null:
                _check_fields(item, spec.spec, file, f"{where}.{key}")
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise _wrong_type(file, where, "a list", value)
        for index, item in enumerate(value):
            _check_fields(item, spec[0], file, f"{where}[{index}]")
        return
    if not isinstance(value, spec) or (spec is int and isinstance(value, bool)):
        raise _wrong_type(file, where, {str: "a string", int: "an integer", list: "a list", dict: "an object"}[spec],
                          value)


def _wrong_type(file: Path, where: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{file}: field {where!r} must be {expected}, found {_json_type(value)}; is the file from this "
                       "samebits version, and whole?")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)


def _verdict(value: Any, where: Path) -> Verdict:
    try:
        return Verdict(value)
    except ValueError:
        raise ConfigError(f"{where}: verdict {value!r} is not one of "
                          f"{', '.join(v.value for v in Verdict)}; is the file from this samebits version?") from None


# ---------------------------------------------------------------------------------------------
# the inputs


def _verify_report(path: Path, summary: dict, say) -> Report:
    verdict = _verdict(summary.get("verdict"), path / "summary.json")
    page = _Page("verify", f"samebits verify: {path}", verdict)
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
                        f"[{index}/{len(todo)}]")
        recorded = check.get("verdict")
        if pair.result is not None and recorded != pair.verdict.value:
            pair.notes.append(f"summary.json says {recorded!r} for this check, but comparing the streams now gives "
                              f"{pair.verdict.value!r}: the streams changed after verify ran (or are damaged).")
        pairs.append(pair)
    page.verify_summary(summary, pairs)
    for pair in pairs:
        page.pair_sections(pair)
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _across_report(path: Path, summary: dict) -> Report:
    """`verify --across dp=...`: runs of different world sizes, compared by rank 0's replicated
    records (not rank by rank), so the verdicts are shown as verify found them."""
    verdict = _verdict(summary.get("verdict"), path / "summary.json")
    page = _Page("verify --across", f"samebits verify --across: {path}", verdict)
    page.verify_summary(summary, [])
    page.notes.append(f"runs of different data-parallel sizes ({', '.join(map(str, summary.get('sizes') or []))}) are "
                      f"compared by the replicated records of rank 0 against {summary.get('reference')}, not rank by "
                      "rank: no heatmap or environment comparison is drawn for them")
    return page.finish([str(path)], [], notes=list(summary.get("notes") or []))


def _bisect_report(path: Path, summary: dict, say) -> Report:
    verdict = _verdict(summary.get("verdict"), path / "summary.json")
    page = _Page("bisect", f"samebits bisect: {path}", verdict)
    page.bisect_summary(summary)
    pairs = []
    first_stage = _first_stage_pair(path)
    if first_stage is not None:
        a, b = first_stage
        start = _later_start(a, b)
        pair = _compare(f"{a.parent.name}: a vs b", a, b, start, True, say, "[1/1]")
        if start:
            pair.notes.append(f"b starts at step {start} (a resumed run): compared from step {start}")
        pairs.append(pair)
        page.pair_sections(pair)
    else:
        page.notes.append("no stage run directories (NN-stage/a, NN-stage/b) were found beside summary.json: "
                          "the heatmap and curves need the streams")
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _matrix_report(path: Path, summary: dict, say) -> Report:
    verdict = _verdict(summary.get("verdict"), path / "summary.json")
    page = _Page("matrix", f"samebits matrix: {path}", verdict)
    page.matrix_summary(summary)
    pairs = []
    failing = [c for c in summary.get("cells") or [] if c.get("verdict") == Verdict.FAIL.value]
    for cell in failing[:MAX_PAIRS]:
        cell_out = Path(str(cell.get("out", "")))
        cell_summary = _summary(cell_out) if cell_out.is_dir() else None
        if cell_summary is None:
            page.notes.append(f"cell {cell.get('cell')} {cell.get('precision')}: no verify output at {cell_out}")
            continue
        for name, other in (("independent", "b"), ("resume", "c")):
            check = (cell_summary.get("checks") or {}).get(name)
            if check is None or check.get("verdict") != Verdict.DIVERGED.value:
                continue
            start = cell_summary.get("resume_at") if name == "resume" else None
            pair = _compare(f"{cell.get('cell')} {cell.get('precision')} {name}: a vs {other}", cell_out / "a",
                            cell_out / other, start, False, say, f"[{len(pairs) + 1}]")
            pairs.append(pair)
            page.pair_sections(pair)
    if len(failing) > MAX_PAIRS:
        page.notes.append(f"{len(failing) - MAX_PAIRS} more failing cell(s) not drawn (see the cells table)")
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _first_stage_pair(path: Path) -> tuple[Path, Path] | None:
    """The first stage's runs of a bisection (rung 1 records every step of the whole run)."""
    stages = []
    for entry in path.iterdir() if path.is_dir() else []:
        match = re.match(r"^(\d+)-", entry.name)
        if match and entry.is_dir() and any((entry / "a").glob("rank-*.sbs")) and any((entry / "b").glob("rank-*.sbs")):
            stages.append((int(match.group(1)), entry))
    if not stages:
        return None
    entry = min(stages)[1]
    return entry / "a", entry / "b"


def _later_start(a: Path, b: Path) -> int | None:
    """The later of the two runs' first recorded steps, when one run starts later (resumed)."""
    firsts = []
    for path in (a, b):
        run = open_run(path)
        try:
            steps = _steps(run, run.ranks[0])
        finally:
            run.close()
        firsts.append(steps[0] if steps else 0)
    return max(firsts) if firsts[0] != firsts[1] else None


def _compare(label: str, a: Path, b: Path, start_step: int | None, allow_config_diff: bool, say,
             counter: str) -> Pair:
    """Compare two runs and read what the page draws from their streams."""
    pair = Pair(label, str(a), str(b), start_step)
    began = time.perf_counter()
    say(f"{counter} comparing {label} ...")
    try:
        pair.result = diff(a, b, start_step=start_step, allow_config_diff=allow_config_diff)
    except (IncomparableRunsError, StreamError) as err:
        pair.error = str(err)
        say(f"      could not compare: {pair.error.splitlines()[0]}")
    run_a, run_b = open_run(a), open_run(b)
    try:
        pair.headers = (run_a.header, run_b.header)
        pair.num_ranks = len(set(run_a.ranks) | set(run_b.ranks))
        for run, steps in ((run_a, pair.steps_a), (run_b, pair.steps_b)):
            for rank in run.ranks[:MAX_RANKS]:
                steps[rank] = _steps(run, rank)
        if pair.result is not None and pair.result.verdict is Verdict.DIVERGED:
            for found in divergent_steps(run_a, run_b, start_step=start_step):
                pair.first_by_rank[found.rank] = (found.step, found.missing)
    except StreamError as err:
        pair.notes.append(f"the streams could not be read for the drawings: {err}")
    finally:
        run_a.close()
        run_b.close()
    say(f"      {pair.verdict.value} ({time.perf_counter() - began:.1f} s)")
    return pair


def _steps(run, rank: int) -> list[int]:
    index = None
    reader = run.stream(rank)
    try:
        index = reader.step_index()
        if index is None:  # not closed cleanly: read the steps it holds (each frame checked)
            return [block.step for block in reader.steps()]
        return [entry[0] for entry in index]
    finally:
        reader.close()


def _records_by_step(path: str, rank: int, steps: set[int] | None, stop_after: int | None = None
                     ) -> dict[int, dict[tuple, Record]]:
    """Decoded records of one rank at the given steps (all steps when None)."""
    run = open_run(path)
    found: dict[int, dict[tuple, Record]] = {}
    try:
        if rank not in run.files:
            return found
        reader = run.stream(rank)
        try:
            for block in reader.steps():
                if stop_after is not None and block.step > stop_after:
                    break
                if steps is None or block.step in steps:
                    found[block.step] = {r.key: r for r in block.records()}
        finally:
            reader.close()
    finally:
        run.close()
    return found


def _metrics(path: str, rank: int) -> dict[int, dict[str, Record]]:
    """The metric records of one rank, per step (steps without metrics left out)."""
    found: dict[int, dict[str, Record]] = {}
    for step, records in _records_by_step(path, rank, None).items():
        metrics = {_key_label(key): r for key, r in records.items() if r.kind == "metric"}
        if metrics:
            found[step] = metrics
    return found


def differing_records(a: str | Path, b: str | Path, *, rank: int, step: int) -> list[dict]:
    """Every record that differs between runs ``a`` and ``b`` at one rank and step (not only
    the first, which is all `diff` keeps): identity, both sides as recorded, and how they
    differ (metrics: ulps and relative difference from the exact bits; tensors: digests only,
    no magnitude is known).  In the step's record order of ``a``, then records only in ``b``."""
    at_a = _records_by_step(str(a), rank, {step}, step).get(step, {})
    at_b = _records_by_step(str(b), rank, {step}, step).get(step, {})
    rows = []
    for key in list(at_a) + [k for k in at_b if k not in at_a]:
        ra, rb = at_a.get(key), at_b.get(key)
        if ra is not None and rb is not None and ra.same_content(rb):
            continue
        kind, phase, name, occurrence = key
        rows.append({"kind": kind, "phase": phase, "name": name, "occurrence": occurrence,
                     "a": None if ra is None else ra.to_dict(), "b": None if rb is None else rb.to_dict(),
                     "difference": _cell(ra, rb, bool(at_a), bool(at_b))[1]})
    return rows


def _key_label(key: tuple) -> str:
    kind, phase, name, occurrence = key
    return f"{phase}/{name}" + (f" #{occurrence}" if occurrence else "")


# ---------------------------------------------------------------------------------------------
# the page


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1150px;color:#1d232a;padding:0 16px}
h1{font-size:22px;margin:0 0 6px}h2{font-size:18px;margin:30px 0 8px;border-bottom:1px solid #d5dbe1;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
table{border-collapse:collapse;margin:6px 0 10px}td,th{border:1px solid #d5dbe1;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f1f4f7}.verdict{display:inline-block;padding:3px 10px;border-radius:4px;font-weight:700;color:#fff}
.v-pass,.v-identical{background:#1a7f37}.v-fail,.v-diverged{background:#c62828}.v-incomplete{background:#9a6700}
.note{color:#57606a}.err{color:#c62828;white-space:pre-wrap}
table.heat td{width:13px;height:15px;padding:0;border:1px solid #fff}table.heat th{font-weight:400;font-size:11px;padding:0 4px;border:0;background:none}
td.h-same{background:#8fd19e}td.h-first{background:#c62828}td.h-after{background:#f2c4c4}td.h-missing{background:#9a6700}
td.h-none{background:#eef1f4}td.h-outside{background:#d0d7de}
.legend span{display:inline-block;width:11px;height:11px;margin:0 4px 0 12px;vertical-align:middle}
td.t-eq{color:#1a7f37;text-align:center}td.t-ne{background:#fbe3e3;color:#8b1a1a;text-align:center}td.t-miss{background:#fff1c2;text-align:center}
.chart{margin:4px 0 14px}
"""


class _Page:
    def __init__(self, kind: str, title: str, verdict: Verdict):
        self.kind, self.title, self.verdict = kind, title, verdict
        self.parts: list[str] = []
        self.sections: list[str] = []
        self.notes: list[str] = []

    def h2(self, text: str, anchor: str) -> None:
        self.sections.append(text)
        self.parts.append(f'<h2 id="{_esc(anchor)}">{_esc(text)}</h2>')

    def add(self, markup: str) -> None:
        self.parts.append(markup)

    def finish(self, inputs: list[str], pairs: list[Pair], notes: list[str] = ()) -> Report:
        notes = list(notes) + self.notes + [n for p in pairs for n in p.notes]
        if notes:
            self.h2("Notes", "notes")
            self.add("<ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
        head = (f'<h1>{_esc(self.title)}</h1><p>verdict: <span class="verdict v-{self.verdict.value}" '
                f'id="verdict">{_esc(self.verdict.value.upper())}</span> '
                f'<span class="note">({_esc(self.kind)}; exit code {self.verdict.exit_code})</span></p>'
                f'<p class="note">made by samebits report at {_esc(time.strftime("%Y-%m-%d %H:%M:%S %Z"))} from '
                + ", ".join(f"<code>{_esc(i)}</code>" for i in inputs) + "</p>")
        toc = "<p>" + " &middot; ".join(f'<a href="#s{i}">{_esc(s)}</a>' for i, s in enumerate(self.sections)) + "</p>"
        body, index = [], 0
        for part in self.parts:
            if part.startswith("<h2 id="):  # number the anchors so the contents links work
                part = re.sub(r'^<h2 id="[^"]*">', f'<h2 id="s{index}">', part)
                index += 1
            body.append(part)
        page = ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
                "img-src data:\">"
                f"<title>{_esc(self.title)}</title><style>{_CSS}</style></head><body>"
                + head + toc + "\n".join(body) + "</body></html>\n")
        return Report(kind=self.kind, inputs=inputs, verdict=self.verdict, sections=list(self.sections),
                      html=page, pairs=pairs, notes=notes)

    # -- summaries of the commands -----------------------------------------------------------

    def verify_summary(self, summary: dict, pairs: list[Pair]) -> None:
        self.h2("Verdicts", "verdicts")
        rows = []
        for name, check in (summary.get("checks") or {}).items():
            if check is None:
                rows.append([name, "not checked", "-", "-"])
                continue
            first = check.get("first_divergence") or {}
            where = "-" if not first else (f"step {first.get('step')}, rank {first.get('rank')}: "
                                           + (f"{first.get('phase')}/{first.get('name')}" if first.get("name")
                                              else str(first.get("detail", ""))))
            c = check.get("compared") or {}
            rows.append([name, check.get("verdict"), f"{c.get('ranks')} x {c.get('steps')} x {c.get('records')}", where])
        self.add(_table(["guarantee", "verdict", "ranks x steps x records", "first divergence"], rows,
                        verdict_column=1))
        if summary.get("resume_at") is not None:
            self.add(f"<p>resume at step {_esc(summary['resume_at'])}: C is compared with A from that step on.</p>")
        runs = summary.get("runs") or []
        if runs:
            self.add("<h3>Runs</h3>" + _table(["run", "exit", "ended", "seconds", "command"],
                                             [[r.get("name"), r.get("exit_code"), r.get("ended"), r.get("seconds"),
                                               r.get("command")] for r in runs]))
        for check, lines in (summary.get("explanations") or {}).items():
            self.add(f"<h3>{_esc(check)}: what differs (most specific first)</h3><ul>"
                     + "".join(f"<li>{_esc(line)}</li>" for line in lines) + "</ul>")
        for key in ("bisect_command", "resume_bisect_command"):
            if summary.get(key):
                self.add(f"<p>to find the origin: <code>{_esc(summary[key])}</code></p>")

    def bisect_summary(self, summary: dict) -> None:
        self.h2("Verdicts", "verdicts")
        self.add(f"<p>compared: {_esc(summary.get('compared', ''))}; wall time {_esc(summary.get('seconds', '?'))} s</p>")
        if summary.get("conclusion"):
            self.add(f"<p><b>{_esc(summary['conclusion'])}</b></p>")
        stages = summary.get("stages") or []
        self.add(_table(["stage", "rung", "traced", "runs (s)", "verdict", "finding"],
                        [[f"{i}. {s.get('name')}", s.get("rung"), s.get("scope"),
                          " ".join(f"{k} {v}" for k, v in (s.get("runs_s") or {}).items()), s.get("verdict"),
                          s.get("summary")] for i, s in enumerate(stages, 1)]))
        self.h2("Origin", "origin")
        control = summary.get("control_flow")
        if control:
            self.add(f"<p>control flow differs: rank {_esc(control.get('rank'))}, step {_esc(control.get('step'))}: "
                     f"{_esc(control.get('detail'))}</p>")
        origin = summary.get("origin")
        if not origin:
            self.add("<p>no origin: " + ("the runs are identical" if summary.get("verdict") == "identical"
                                         else "the bisection did not localise one (see the stages)") + "</p>")
            return
        rows = [[key, origin.get(key)] for key in ("conclusion", "kind", "classification", "step", "rank", "phase",
                                                   "module", "op", "id", "category", "call_site", "detail",
                                                   "catalog") if origin.get(key) not in (None, "")]
        for key in ("state_differs", "params", "ranks"):
            if origin.get(key):
                rows.append([key, ", ".join(map(str, origin[key]))])
        self.add('<table id="origin">' + "".join(f"<tr><th>{_esc(k)}</th><td>{_esc(v)}</td></tr>" for k, v in rows)
                 + "</table>")
        elements = origin.get("elements")
        if elements:
            self.add("<h3>Elements of the origin's output (from the element dumps)</h3>"
                     f"<p>{_esc(elements.get('differing'))} of {_esc(elements.get('total'))} elements differ in output "
                     f"{_esc(elements.get('output'))} ({_esc(elements.get('dtype'))} {_esc(elements.get('shape'))}); "
                     f"max {_esc(elements.get('max_ulp'))} ulp"
                     + ("; the same values in another order" if elements.get("same_values") else "")
                     + (f"; inputs identical: {_esc(elements.get('inputs_identical'))}" if "inputs_identical" in elements
                        else "") + "</p>")
            values = elements.get("values") or []
            if values:
                self.add(_table(["index", "a", "b", "ulp"], [[v.get("index"), repr(v.get("a")), repr(v.get("b")),
                                                              v.get("ulp")] for v in values]))
            if elements.get("dumps"):
                self.add("<p class=\"note\">dumps: " + ", ".join(f"<code>{_esc(d)}</code>" for d in elements["dumps"])
                         + "</p>")

    def matrix_summary(self, summary: dict) -> None:
        self.h2("Verdicts", "verdicts")
        cells = summary.get("cells") or []
        rows = []
        for c in cells:
            agreement = c.get("agreement") or {}
            agree = agreement.get("status", "")
            if agreement.get("first_step") is not None:
                agree += f" at step {agreement['first_step']}"
            if agreement.get("max_ulp") is not None:
                agree += f", {agreement['max_ulp']} ulp"
            rows.append([c.get("cell"), c.get("precision"), c.get("world_size"), "yes" if c.get("required") else "",
                         c.get("verdict"), c.get("repeatable"), c.get("resume"), agree, c.get("reason") or ""])
        self.add(f"<p>baseline: {_esc(summary.get('baseline'))}</p>")
        self.add(_table(["cell", "precision", "world", "required", "verdict", "A = B", "A = C", "agrees with baseline",
                         "reason"], rows, verdict_column=4))
        for line in summary.get("failures") or []:
            self.add(f"<p class=\"err\">{_esc(line)}</p>")

    # -- one compared pair --------------------------------------------------------------------

    def pair_sections(self, pair: Pair) -> None:
        self.h2(f"{pair.label}: {pair.verdict.value}", f"pair-{pair.label}")
        self.add(f'<p>a = <code>{_esc(pair.a)}</code>, b = <code>{_esc(pair.b)}</code>'
                 + (f", from step {_esc(pair.start_step)}" if pair.start_step else "") + "</p>")
        result = pair.result
        if result is None:
            self.add(f'<p class="err">could not compare: {_esc(pair.error)}</p>')
        else:
            self._diff_summary(result)
            self._heatmap(pair)
            self._tensors(pair)
        self._curves(pair)
        self._environment(pair)

    def _diff_summary(self, result: DiffResult) -> None:
        c = result.compared
        self.add(f'<p>verdict: <span class="verdict v-{result.verdict.value}">{_esc(result.verdict.value.upper())}'
                 f"</span> {_esc(c.get('ranks'))} rank(s) x {_esc(c.get('steps'))} step(s), {_esc(c.get('records'))} "
                 + ("records compared before the first divergence</p>" if result.first_divergence is not None
                    else "records compared</p>"))
        d = result.first_divergence
        if d is not None:
            where = f"{d.phase}/{d.name}" if d.name is not None else d.detail
            self.add(f"<p><b>first divergence: step {_esc(d.step)}, rank {_esc(d.rank)}: {_esc(where)}</b> "
                     f"({_esc(d.records_differing)} record(s) differ in that step; ranks diverged first: "
                     f"{_esc(', '.join(map(str, result.ranks_diverged_first)))})</p>"
                     f"<p class=\"mono\">{_esc(d.detail)}</p>")
        for reason in result.incomplete:
            self.add(f'<p class="err">incomplete: {_esc(reason)}</p>')

    def _heatmap(self, pair: Pair) -> None:
        self.h2(f"{pair.label}: first divergence by rank and step", "heat")
        ranks = sorted(set(pair.steps_a) | set(pair.steps_b))
        steps = sorted({s for steps in list(pair.steps_a.values()) + list(pair.steps_b.values()) for s in steps})
        if not ranks or not steps:
            self.add("<p>no steps recorded</p>")
            return
        shown_steps = steps[:MAX_STEPS]
        first_steps = [s for s, _ in pair.first_by_rank.values()]
        if first_steps and min(first_steps) not in shown_steps:  # keep the first divergence in view
            at = steps.index(min(first_steps))
            shown_steps = steps[max(0, at - MAX_STEPS // 2):][:MAX_STEPS]
        start = pair.start_step or 0
        rows = []
        header = "".join(f'<th title="step {s}">{s if s % 5 == 0 or s == shown_steps[0] else ""}</th>'
                         for s in shown_steps)
        for rank in ranks:
            in_a, in_b = set(pair.steps_a.get(rank, ())), set(pair.steps_b.get(rank, ()))
            first = pair.first_by_rank.get(rank)
            cells = []
            for step in shown_steps:
                if step < start:
                    state, text = "outside", "before the compared window"
                elif first is not None and step == first[0]:
                    state = "first"
                    text = "first divergence" + (f" (run {first[1]} has no such step)" if first[1] else "")
                elif first is not None and step > first[0]:
                    state, text = "after", "after this rank's first divergence"
                elif step in in_a and step in in_b:
                    state, text = "same", "identical"
                elif step in in_a or step in in_b:
                    state, text = "missing", f"only in run {'a' if step in in_a else 'b'}"
                else:
                    state, text = "none", "not recorded"
                cells.append(f'<td class="h-{state}" title="rank {rank}, step {step}: {_esc(text)}"></td>')
            rows.append(f"<tr><th>rank {rank}</th>{''.join(cells)}</tr>")
        legend = "".join(f'<span class="h-{k}" style="background:{c}"></span>{_esc(t)}' for k, c, t in (
            ("same", "#8fd19e", "identical"), ("first", "#c62828", "first divergence"),
            ("after", "#f2c4c4", "after it (not compared further)"), ("missing", "#9a6700", "in one run only"),
            ("outside", "#d0d7de", "outside the window")))
        self.add(f'<table class="heat" id="heatmap"><tr><th></th>{header}</tr>{"".join(rows)}</table>'
                 f'<p class="legend">{legend}</p>')
        if pair.first_by_rank:
            by_rank = ", ".join(f"rank {r}: step {s}" for r, (s, _) in sorted(pair.first_by_rank.items()))
            self.add(f"<p>first divergent step per rank: {_esc(by_rank)}; ranks with no divergence: "
                     f"{_esc(', '.join(str(r) for r in ranks if r not in pair.first_by_rank) or 'none')}</p>")
        cut = []
        if len(steps) > len(shown_steps):
            cut.append(f"{len(steps) - len(shown_steps)} step(s) not drawn")
        if pair.num_ranks > len(ranks):
            cut.append(f"{pair.num_ranks - len(ranks)} rank(s) beyond the first {MAX_RANKS} not drawn")
        if cut:
            self.add(f"<p class=\"note\">{_esc('; '.join(cut))}</p>")

    def _tensors(self, pair: Pair) -> None:
        title = f"{pair.label}: records that differ, step by step"
        self.h2(title, "tensors")
        d = pair.result.first_divergence if pair.result is not None else None
        if d is None:
            self.add("<p>no record differs in the compared window.</p>")
            return
        rank = d.rank
        steps_a, steps_b = pair.steps_a.get(rank, []), pair.steps_b.get(rank, [])
        wanted = sorted({s for s in set(steps_a) | set(steps_b) if s >= d.step})[:MAX_TENSOR_STEPS]
        try:
            records_a = _records_by_step(pair.a, rank, set(wanted), wanted[-1] if wanted else None)
            records_b = _records_by_step(pair.b, rank, set(wanted), wanted[-1] if wanted else None)
        except StreamError as err:  # damaged after the first divergence: the divergence still stands
            self.add(f'<p class="err">the records after the first divergence could not be read: {_esc(err)}</p>')
            return
        differing: dict[tuple, dict[int, tuple[str, str]]] = {}
        for step in wanted:
            at_a, at_b = records_a.get(step, {}), records_b.get(step, {})
            for key in list(at_a) + [k for k in at_b if k not in at_a]:
                ra, rb = at_a.get(key), at_b.get(key)
                if ra is not None and rb is not None and ra.same_content(rb):
                    continue
                differing.setdefault(key, {})[step] = _cell(ra, rb, step in records_a, step in records_b)
        rows_html = []
        keys = list(differing)[:MAX_TENSOR_ROWS]
        for key in keys:
            cells = []
            for step in wanted:
                if step in differing[key]:
                    css, text = differing[key][step]
                    cells.append(f'<td class="{css}" title="{_esc(text)}">{_esc(text)}</td>')
                else:
                    cells.append('<td class="t-eq">=</td>')
            rows_html.append(f"<tr><th class=\"mono\">{_esc(_key_label(key))}</th><td>{_esc(key[0])}</td>"
                             f"{''.join(cells)}</tr>")
        head = "".join(f"<th>step {s}</th>" for s in wanted)
        self.add(f"<p>rank {rank} (the first to diverge), from step {d.step}: each cell says whether the record "
                 "is bit-identical (=) or how it differs. Metrics: distance in ulps and relative difference, exact "
                 "from the recorded bits. Tensors: <b>digests only: values not recorded</b> (no magnitude is "
                 "known; `samebits bisect` dumps the origin op's elements).</p>"
                 f'<table id="per-tensor"><tr><th>record</th><th>kind</th>{head}</tr>{"".join(rows_html)}</table>')
        if len(differing) > len(keys):
            self.add(f"<p class=\"note\">{len(differing) - len(keys)} more differing record(s) not listed</p>")

    def _curves(self, pair: Pair) -> None:
        rank = 0
        if pair.result is not None and pair.result.first_divergence is not None:
            rank = pair.result.first_divergence.rank
        try:
            metrics_a, metrics_b = _metrics(pair.a, rank), _metrics(pair.b, rank)
        except StreamError as err:
            self.add(f"<p class=\"err\">metric curves: {_esc(err)}</p>")
            return
        names = sorted({n for m in list(metrics_a.values()) + list(metrics_b.values()) for n in m})
        title = f"{pair.label}: metric curves (rank {rank})"
        self.h2(title, "curves")
        if not names:
            self.add("<p>no metrics recorded (Recorder.metrics) on this rank.</p>")
            return
        self.add("<p>a: solid line, b: dashed line; each step of b is marked green where the metric has the same "
                 "bits in both runs and red where it does not (hover for the values).</p>")
        for name in names[:12]:
            self.add(_chart(name, {s: m[name] for s, m in metrics_a.items() if name in m},
                            {s: m[name] for s, m in metrics_b.items() if name in m}, pair.start_step or 0))
        if len(names) > 12:
            self.add(f"<p class=\"note\">{len(names) - 12} more metric(s) not drawn</p>")

    def _environment(self, pair: Pair) -> None:
        title = f"{pair.label}: environment and config"
        self.h2(title, "env")
        header_a, header_b = pair.headers
        if not header_a and not header_b:
            self.add("<p>the stream headers could not be read.</p>")
            return
        rows, same, own = [], 0, []
        for section in ("environment", "config"):
            flat_a, flat_b = _flatten(header_a.get(section) or {}), _flatten(header_b.get(section) or {})
            for key in sorted(set(flat_a) | set(flat_b)):
                va, vb = flat_a.get(key, "(absent)"), flat_b.get(key, "(absent)")
                if va == vb:
                    same += 1
                elif section == "environment" and key.startswith(_OWN_VARIABLES):
                    own.append(key.removeprefix("env."))  # each run's own directory, reference, offset
                else:
                    rows.append([f"{section}.{key}", va, vb])
        if rows:
            self.add(f"<p>{len(rows)} difference(s) in the recorded environment and config ({same} equal "
                     "entries not shown):</p>" + _table(["key", "a", "b"], rows, table_id="env-diff"))
        else:
            self.add(f"<p>the recorded environment and config are the same ({same} entries).</p>")
        if own:
            self.add(f"<p class=\"note\">not differences of the training: samebits' and the launcher's own per-run "
                     f"settings ({_esc(', '.join(own))})</p>")
        env = header_a.get("environment") or {}
        facts = [[k, env.get(k)] for k in ("torch", "python", "platform", "hostname", "num_threads", "cuda",
                                           "device", "deterministic_algorithms") if k in env]
        if facts:
            self.add("<h3>run a</h3>" + _table(["", "value"], facts))


def _flatten(data: Any, prefix: str = "") -> dict[str, str]:
    out = {}
    if isinstance(data, dict):
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}{key}." if isinstance(value, dict) else f"{prefix}{key}")
                       if isinstance(value, dict) else {f"{prefix}{key}": json.dumps(value, default=str)})
    return out


def _cell(a: Record | None, b: Record | None, step_in_a: bool, step_in_b: bool) -> tuple[str, str]:
    if a is None or b is None:
        if not step_in_a or not step_in_b:
            return "t-miss", f"step only in run {'a' if step_in_a else 'b'}"
        return "t-miss", f"only in run {'a' if a is not None else 'b'}"
    if a.kind == "metric":
        ulp, relative = metric_distance(a, b)
        parts = [f"{ulp} ulp" if ulp is not None else "bits differ"]
        if relative is not None:
            parts.append(f"rel {relative:.2e}")
        return "t-ne", ", ".join(parts)
    if a.shape != b.shape or a.dtype != b.dtype:
        return "t-ne", f"{a.dtype}{list(a.shape or ())} vs {b.dtype}{list(b.shape or ())}"
    return "t-ne", "digest differs"


def _table(headers: list[str], rows: list[list[Any]], verdict_column: int | None = None,
           table_id: str | None = None) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for i, value in enumerate(row):
            text = "" if value is None else _esc(value)
            css = f' class="verdict v-{text}"' if i == verdict_column and text in {v.value for v in Verdict} else ""
            cells.append(f"<td{css}>{text}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    ident = f' id="{_esc(table_id)}"' if table_id else ""
    return f"<table{ident}><tr>{head}</tr>{''.join(body)}</table>"


_DASHED = 'stroke-dasharray="5,4"'


def _chart(name: str, series_a: dict[int, Record], series_b: dict[int, Record], start: int) -> str:
    """One metric of both runs as an inline SVG line chart, b's steps marked by bit agreement."""
    width, height, left, right, top, bottom = 760, 170, 70, 12, 12, 26
    steps = sorted(set(series_a) | set(series_b))[:MAX_STEPS * 4]
    values = [v for s in steps for v in (float_value(series_a[s]) if s in series_a else None,
                                        float_value(series_b[s]) if s in series_b else None)
              if v is not None and math.isfinite(v)]
    equal = sum(1 for s in steps if s in series_a and s in series_b and series_a[s].raw == series_b[s].raw)
    both = sum(1 for s in steps if s in series_a and s in series_b)
    first_diff = next((s for s in steps if s in series_a and s in series_b and series_a[s].raw != series_b[s].raw), None)
    caption = f"{name}: {equal} of {both} common step(s) bit-identical"
    if first_diff is not None:
        ulp, relative = metric_distance(series_a[first_diff], series_b[first_diff])
        caption += (f"; first differing step {first_diff}: a = {series_a[first_diff].summary()}, "
                    f"b = {series_b[first_diff].summary()}" + (f", {ulp} ulp" if ulp is not None else "")
                    + (f", relative {relative:.3e}" if relative is not None else ""))
    if not steps or not values:
        return f"<p class=\"mono\">{_esc(caption)} (no finite values to draw)</p>"
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 1.0 if low == 0 else low - abs(low) * 0.05, high + 1.0 if high == 0 else high + abs(high) * 0.05
    first_step, last_step = steps[0], steps[-1]
    span = max(last_step - first_step, 1)

    def x(step: int) -> float:
        return left + (step - first_step) / span * (width - left - right)

    def y(value: float) -> float:
        return top + (high - value) / (high - low) * (height - top - bottom)

    def line(series: dict[int, Record], dash: str, colour: str) -> str:
        points = []
        for s in steps:
            value = float_value(series[s]) if s in series else None
            if value is not None and math.isfinite(value):
                points.append(f"{x(s):.1f},{y(value):.1f}")
        if not points:
            return ""
        return (f'<polyline fill="none" stroke="{colour}" stroke-width="1.6" {dash} points="{" ".join(points)}"/>')

    marks = []
    for s in steps:
        if s not in series_b:
            continue
        value = float_value(series_b[s])
        if value is None or not math.isfinite(value):
            continue
        if s not in series_a:
            colour, what = "#9a6700", "only in b"
        elif series_a[s].raw == series_b[s].raw:
            colour, what = "#1a7f37", "same bits"
        else:
            colour, what = "#c62828", "bits differ"
        tip = f"step {s}: {what}; a = {series_a[s].summary() if s in series_a else '-'}, b = {series_b[s].summary()}"
        marks.append(f'<circle class="mark-{"eq" if colour == "#1a7f37" else "ne"}" cx="{x(s):.1f}" cy="{y(value):.1f}" '
                     f'r="3" fill="{colour}"><title>{_esc(tip)}</title></circle>')
    axis = (f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#8c959f"/>'
            f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#8c959f"/>'
            f'<text x="{left - 4}" y="{top + 4}" text-anchor="end" font-size="10">{_esc(f"{high:.6g}")}</text>'
            f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end" font-size="10">{_esc(f"{low:.6g}")}</text>'
            f'<text x="{left}" y="{height - 8}" font-size="10">step {first_step}</text>'
            f'<text x="{width - right}" y="{height - 8}" text-anchor="end" font-size="10">step {last_step}</text>')
    window = ""
    if start > first_step:
        window = (f'<rect x="{left}" y="{top}" width="{max(x(start) - left, 0):.1f}" height="{height - top - bottom}" '
                  'fill="#eef1f4"><title>before the compared window</title></rect>')
    svg = (f'<svg class="chart" width="{width}" height="{height}" viewBox="0 0 {width} {height}" role="img">'
           f'<title>{_esc(name)}</title>{window}{axis}'
           f'{line(series_a, "", "#0969da")}{line(series_b, _DASHED, "#bc4c00")}'
           f'{"".join(marks)}</svg>')
    return f"<h3 class=\"mono\">{_esc(name)}</h3><p class=\"mono\">{_esc(caption)}</p>{svg}"


__all__ = ["build_report", "write_report", "differing_records", "Report", "Pair"]
