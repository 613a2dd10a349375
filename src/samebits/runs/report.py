"""`samebits report`: one self-contained HTML page of what a verify, bisect, matrix or diff found.

The page is built from what is on disk, never from memory of a run: the summary a command
wrote (``summary.json`` of `samebits verify`, `bisect` or `matrix`) and the streams of its runs,
which are compared again here with `samebits.compare` (every frame checked, every root
recomputed), so the page shows evidence it re-derived rather than copied.  Two run directories
are compared directly.

The page leads with the command's conclusion, the sentence the terminal printed
(`samebits.runs.conclusion`).  Then, per compared pair of runs: the verdict; the growth of the
difference in ulps per step (log scale, per metric, exact from the recorded bits; tensors are
digests only, so params, grads and optimizer state get the steps where they differ and the page
says no magnitude is known); the metric curves of both runs (loss, grad norm, lr: a solid, b
dashed, with a legend naming the runs); a heatmap of where the runs differ (records x steps for
one or two ranks, ranks x steps, binned, for many); which records differ at each step after the
first divergence; the origin of a bisection with its call site and element detail (from the
bisection's own element dumps); the difference between the runs' recorded environments and
configs.  Steps a run never ran because the live check stopped it at its first divergence are
shown as such ("not run past the first divergence"), never as a difference.

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

from samebits.autorecord import read_stop
from samebits.compare import DiffResult, diff, divergent_steps
from samebits.errors import ConfigError, IncomparableRunsError, StreamError
from samebits.runs.conclusion import (across_conclusion, bisect_conclusion, diff_conclusion, diff_window,
                                      matrix_conclusion, verify_conclusion, window_words)
from samebits.runs._launch import STOPPED
from samebits.runs.across import CONTROL_STEPS
from samebits.runs.distance import float_value, metric_distance
from samebits.runs._state_positions import StatePicture, StateTrack, state_positions
from samebits.stream import Record, open_run
from samebits.verdicts import EXIT_STOPPED, ToDict, Verdict, serialised

MAX_RANKS = 64  # heatmap rows of ranks; a larger world is binned, each row a range of ranks
MAX_READ_RANKS = 16384  # ranks whose steps are read for the heatmap (the rest are counted, not drawn)
MAX_STEPS = 120  # heatmap columns; more steps are binned, each column a range of steps
MAX_GROUP_ROWS = 32  # heatmap rows of record groups (one or two ranks)
MAX_TENSOR_ROWS = 40  # per-tensor table rows (records that differ at some step)
MAX_LEAVES = 4  # a module row names this many of its differing records per group, then "..."
MAX_TENSOR_STEPS = 12  # per-tensor table columns, from the first divergent step on (no sideways scroll)
MAX_CURVES = 12  # metric curves drawn per pair
MAX_STATE_CHARTS = 8  # census records drawn per pair (the rest are listed)
# What a person calls the recorded metrics: zero-code recording records the root of backward()
# (the loss), the recipe records loss, grad_norm and lr under "metrics".
_METRIC_NAMES = {"backward/root": "loss", "metrics/loss": "loss", "metrics/grad_norm": "grad norm",
                 "metrics/lr": "lr", "metrics/learning_rate": "lr"}
_METRIC_ORDER = ("loss", "grad norm", "lr")
_GROUP_NAMES = {"optimizer": "optimizer state", "forward": "activations", "data": "inputs"}
_GROUP_ORDER = ("params", "grads", "optimizer state", "activations", "inputs")
_COLOURS = ("#0969da", "#8250df", "#1a7f37", "#bc4c00", "#1b7c83", "#bf3989", "#6e7781", "#953800")
COLOUR_A, COLOUR_B = "#0969da", "#e36209"
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
    start_step: int | None = None  # the first step compared: the one given, or the one diff chose (a resumed b)
    window: str = ""  # why the comparison starts there, in words (`window_words`); "" for every step
    result: DiffResult | None = None
    error: str = ""  # why the runs could not be compared (then result is None)
    first_by_rank: dict[int, tuple[int, str | None]] = field(default_factory=dict)  # rank -> (step, missing side)
    steps_a: dict[int, list[int]] = field(default_factory=dict)  # rank -> recorded steps
    steps_b: dict[int, list[int]] = field(default_factory=dict)
    headers: tuple[dict, dict] = ({}, {})
    num_ranks: int = 0  # recorded ranks (the heatmap bins them into MAX_RANKS rows)
    notes: list[str] = field(default_factory=list)
    names: tuple[str, str] = ("run a", "run b")  # what the legends call a and b
    stopped_b: int | None = None  # the step at which the live check stopped run b (its first divergence)
    context: str = ""  # what the diff's first record means on this page (a bisection explains it)
    independent: str | None = None  # a verify's run B beside a resume pair: census records that differ A to B too
    census_summary: dict = field(default_factory=dict)  # what the state census picture shows (`StatePicture`)
    _cache: dict = field(default_factory=dict, repr=False)  # what the drawings read or derive, once

    def view(self, rank: int) -> _RankView:
        """What the plots draw of one rank (`_read_rank`), read once: the ulp plot, the curves and
        the heatmap share it."""
        key = ("view", rank)
        if key not in self._cache:
            self._cache[key] = _read_rank(self, rank)
        return self._cache[key]

    def ran(self, side: str, rank: int, step: int) -> bool:
        """Whether run ``side`` recorded ``step`` on ``rank`` (sets built once per rank)."""
        key = ("steps", side, rank)
        if key not in self._cache:
            self._cache[key] = set((self.steps_a if side == "a" else self.steps_b).get(rank, ()))
        return step in self._cache[key]

    def cut(self, step: int) -> bool:
        """Whether run b never ran ``step``: the live check stopped it at an earlier one."""
        if self.stopped_b is None or step <= self.stopped_b:
            return False
        if "steps b" not in self._cache:
            self._cache["steps b"] = {s for steps in self.steps_b.values() for s in steps}
        return step not in self._cache["steps b"]

    @property
    def verdict(self) -> Verdict:
        return self.result.verdict if self.result is not None else Verdict.INCOMPLETE

    @property
    def conclusion(self) -> str:
        """This comparison's one sentence (`diff_conclusion`, as `samebits diff` prints it): the
        page's pair section, the terminal's table and the JSON all say this one."""
        if self.result is None:
            return f"INCOMPLETE: could not compare: {self.error.splitlines()[0] if self.error else ''}"
        return diff_conclusion(self.result.to_dict())


def _layout_check_where(check: dict) -> str:
    """Where a `verify --across` check (a layout's, or a resume's) first differs, or why it
    could not decide; "-" for neither."""
    first = check.get("first_divergence") or {}
    where = "-" if not first else f"step {first.get('step')}: {first.get('phase')}/{first.get('name')}"
    if check.get("verdict") == Verdict.INCOMPLETE.value:
        where = "; ".join((check.get("incomplete") or [])[:1]) or where
    return where


def _pair_summary(pair: Pair) -> dict:
    """A compared pair in the report's JSON: which runs, from which step and why (the window),
    the verdict and its sentence, the first divergence, and each rank's first divergent step
    (in the same window, so rank by rank agrees with the first divergence)."""
    first = pair.result.first_divergence if pair.result is not None else None
    return {"label": pair.label, "a": pair.a, "b": pair.b, "start_step": pair.start_step, "window": pair.window,
            "verdict": pair.verdict.value, "conclusion": pair.conclusion, "error": pair.error,
            "first_divergence": None if first is None else {
                "step": first.step, "rank": first.rank,
                "record": _where_of(first)},
            "first_divergent_step_by_rank": {str(r): s for r, (s, _) in sorted(pair.first_by_rank.items())},
            **({"census": pair.census_summary} if pair.census_summary else {})}


def _where_of(divergence) -> str:
    """A divergence's record (phase/name), or what it says when it has no record."""
    return f"{divergence.phase}/{divergence.name}" if divergence.name is not None else divergence.detail


@dataclass
class Report(ToDict):
    """The page and what it says: ``kind`` (verify, bisect, matrix, diff), the overall
    ``verdict`` (as the command that produced the inputs decided it, or the diff's), the
    section headings, the HTML text."""

    dict_keys = ("kind", "verdict", "exit_code", "conclusion", "inputs", "out", "sections", "pairs", "notes")

    kind: str
    inputs: list[str]
    verdict: Verdict
    sections: list[str]
    html: str = field(metadata=serialised(skip=True))  # the page itself, written to `out`
    pairs: list[Pair] = field(metadata=serialised(convert=lambda pairs: [_pair_summary(p) for p in pairs]))
    notes: list[str] = field(default_factory=list)
    out: str = ""
    conclusion: str = ""  # the sentence the page leads with, as the terminal printed it
    stopped: str = ""  # why the command did not finish (its summary says "stopped"): no verdict, exit 3

    @property
    def exit_code(self) -> int:
        return EXIT_STOPPED if self.stopped else self.verdict.exit_code

    def dict_extras(self) -> dict:
        return {"exit_code": self.exit_code, **({"stopped": self.stopped} if self.stopped else {})}


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
        page.conclusion = (diff_conclusion(pair.result.to_dict()) if pair.result is not None else
                           f"INCOMPLETE: could not compare: {pair.error.splitlines()[0] if pair.error else ''}")
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
    if summary.get("verdict") == STOPPED:
        return _stopped_report(path, summary)
    if "cells" in summary:
        return _matrix_report(path, summary, say)
    if "stages" in summary:
        return _bisect_report(path, summary, say)
    if "checks" in summary and ("sizes" in summary or "layouts" in summary):
        return _across_report(path, summary)
    if "checks" in summary:
        return _verify_report(path, summary, say)
    raise ConfigError(f"{path / 'summary.json'}: not a summary of samebits verify, bisect or matrix (no 'checks', "
                      "'stages' or 'cells'); give the output directory of one of those commands.")


MAX_JSON_BYTES = 64 << 20  # a summary or certificate larger than this is refused (they are kilobytes)
MAX_JSON_DEPTH = 64  # nesting deeper than this is refused (the files nest a few levels)


def _summary(path: Path) -> dict | None:
    """The ``summary.json`` in ``path``, checked field by field (`_SUMMARY`): None when there is
    none; `ConfigError` naming the file and the field when it is not a regular file, not JSON,
    or a field has the wrong type (a page is never built from a summary it would misread)."""
    data = _json_file(path / "summary.json", "the summary.json a samebits command wrote")
    if data is None:
        return None
    file = path / "summary.json"
    kind = "matrix" if "cells" in data else "bisect" if "stages" in data else "verify" if "checks" in data else None
    if kind is not None:  # (an object of none of them is refused by `build_report`, with what it expected)
        _check_fields(data, _SUMMARY[kind], file, "")
    return data


def _json_file(file: Path, expected: str) -> dict | None:
    """The JSON object in ``file`` (None when there is none), read as every input is: a regular
    file only (a FIFO must not block), at most `MAX_JSON_BYTES`, JSON nested at most
    `MAX_JSON_DEPTH` deep; `ConfigError` naming the file otherwise."""
    try:
        # O_NONBLOCK: a FIFO in place of the file must not block the open
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
        raise ConfigError(f"{file}: {kind}, not a regular file; expected {expected}.")
    with os.fdopen(fd, "rb") as handle:
        try:
            raw = handle.read(MAX_JSON_BYTES + 1)
        except OSError as err:
            raise ConfigError(f"{file}: cannot be read ({err.strerror or err}).") from None
    if len(raw) > MAX_JSON_BYTES:
        raise ConfigError(f"{file}: larger than {MAX_JSON_BYTES >> 20} MiB; expected {expected} (a few kilobytes).")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
        reason = "nested too deeply" if isinstance(err, RecursionError) else str(err)
        raise ConfigError(f"{file}: cannot be read as JSON ({reason}); was the command interrupted while writing "
                          "it? Re-run the command, or report two of its run directories instead.") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: not {expected} (a JSON object was expected, found {_json_type(data)}).")
    if _depth(data) > MAX_JSON_DEPTH:
        raise ConfigError(f"{file}: nested more than {MAX_JSON_DEPTH} levels deep; expected {expected}.")
    return data


def _depth(value: Any) -> int:
    """How deep ``value`` nests (1 for a leaf), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((child, depth + 1) for child in children)
    return deepest


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


_CHECK = {"verdict": str, "first_divergence": dict, "compared": dict, "notes": list, "incomplete": list, "by": str,
          "counts": _Each(int)}
_CONTROL = {"verdict": str, "differs": bool, "first_step": int, "layout": str, "run": str}
_SUMMARY = {
    "verify": {"verdict": _Required(str), "checks": _Each(_CHECK, null=True), "resume_at": int, "runs": [dict],
               "explanations": _Each(list), "notes": list, "sizes": list, "layouts": list, "reference": str,
               "controls": [_CONTROL], "controls_note": str, "checkpoints_equal": bool,
               "resume_across": {"step": int, "from": str, "checks": _Each(_CHECK)}},
    "bisect": {"verdict": _Required(str), "stages": [{"runs_s": dict}], "control_flow": dict,
               "origin": {"elements": {"values": [dict], "dumps": list}, "state_differs": list, "params": list,
                          "ranks": list},
               "notes": list},
    "matrix": {"verdict": _Required(str), "cells": [{"agreement": dict, "out": str, "explanations": _Each(list),
                                                     "bisect": dict, "verdict": str, "repeatable": str,
                                                     "resume": str}], "failures": list, "notes": list},
}


# certificate.json (`samebits.runs.across.certificate`), as the page reads it
_CERT_CHECK = {"verdict": _Required(str), "by": str, "steps": int, "counts": _Each(int), "notes": [str],
               "incomplete": [str], "command": str, "first_divergence": dict}
_CERTIFICATE = {
    "verdict": _Required(str), "kind": str, "environment": dict, "reference": str,
    "layouts": [{"cell": str, "world_size": int, "overrides": [str], "command": str}],
    "steps": [int], "roots": _Each(_Each(str, null=True)), "roots_equal": bool,
    "checkpoints": _Each({"step": int, "path": str, "content_sha256": str, "state_sha256": str, "content_error": str,
                          "files": int, "files_sha256": str, "sha256": str, "state_parts": dict}),
    "checkpoints_equal": bool, "checkpoints_note": str,
    "resume_across": {"step": int, "from": str, "checks": _Each(_CERT_CHECK)},
    "invariant_reductions": [{"switch": str, "size": str, "covers": str}],
    "controls": [{**_CONTROL, "detail": str, "overrides": [str], "command": str}], "controls_note": str,
    "checks": _Each(_CERT_CHECK),
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
        raise _wrong_type(file, where, {str: "a string", int: "an integer", list: "a list", dict: "an object",
                                        bool: "true or false"}[spec], value)


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


# -- every verdict shown is re-derived from the checks shown -----------------------------------
#
# A summary (or certificate) whose verdict word contradicts its own checks was edited or damaged:
# it is refused (exit 2), never shown.  A verdict more cautious than its checks (INCOMPLETE where
# the checks alone give PASS: verify's gaps, say) stands, said in the notes.


def _check_verdict(check: dict, file: Path, where: str) -> Verdict:
    """A check's verdict word, held to the evidence the check carries: DIVERGED needs its first
    divergence; IDENTICAL allows none, nor anything incomplete, missing or compared by shape only."""
    verdict = _verdict(check.get("verdict"), file)
    counts = check.get("counts") or {}
    gaps = [what for what, bad in (("a first divergence", check.get("first_divergence")),
                                   ("incomplete lines", check.get("incomplete")),
                                   ("missing records", counts.get("missing")),
                                   ("records compared by shape only", counts.get("shape_only")))
            if bad]
    if verdict is Verdict.DIVERGED and "first_divergence" in check and not check["first_divergence"]:
        raise _contradiction(file, f"{where} says 'diverged' but names no first divergence")
    if verdict is Verdict.IDENTICAL and gaps:
        raise _contradiction(file, f"{where} says 'identical' but holds {gaps[0]}")
    return verdict


def _contradiction(file: Path, why: str) -> ConfigError:
    return ConfigError(f"{file}: {why}: its verdicts contradict its checks, so the file was edited or damaged after "
                       "the command wrote it; samebits report shows only verdicts it can re-derive. Re-run the "
                       "command (or report two of its run directories).")


def _settle(claimed: Verdict, derived: Verdict, file: Path, why: str, notes: list[str]) -> Verdict:
    """The verdict to show: ``derived`` (from the checks); a ``claimed`` INCOMPLETE stands (more
    cautious, with a note); any other disagreement is refused."""
    if claimed is derived:
        return derived
    if claimed is Verdict.INCOMPLETE:
        notes.append(f"{file.name} says INCOMPLETE where its checks alone give {derived.value.upper()} ({why}): "
                     "shown as INCOMPLETE")
        return claimed
    raise _contradiction(file, f"it says {claimed.value!r} but its checks give {derived.value!r} ({why})")


def _verify_verdict(summary: dict, file: Path) -> tuple[Verdict, str]:
    """verify's verdict from its checks (`samebits.runs.verify.VerifyResult.verdict`)."""
    verdicts = {name: _check_verdict(check, file, f"check {name!r}")
                for name, check in (summary.get("checks") or {}).items() if check is not None}
    why = ", ".join(f"{name}: {v.value}" for name, v in verdicts.items()) or "no check"
    if Verdict.DIVERGED in verdicts.values():
        return Verdict.FAIL, why
    if not verdicts or any(v is not Verdict.IDENTICAL for v in verdicts.values()):
        return Verdict.INCOMPLETE, why
    return Verdict.PASS, why


def _control_differs(control: dict) -> bool:
    step = control.get("first_step")
    return control.get("verdict") == Verdict.DIVERGED.value and isinstance(step, int) and \
        not isinstance(step, bool) and step < CONTROL_STEPS


def _checkpoints_equal(checkpoints: dict | None) -> bool | None:
    """Whether the final checkpoints hold one state (content and, where hashed, resumable state):
    None when there are none or one lacks its content hash."""
    entries = list((checkpoints or {}).values())
    if not entries or any(not isinstance(e, dict) or not e.get("content_sha256") for e in entries):
        return None
    return all(len({e.get(key) for e in entries}) == 1 for key in ("content_sha256", "state_sha256"))


def _across_verdict(data: dict, file: Path) -> tuple[Verdict, str]:
    """`verify --across`'s verdict from its checks, resumes, controls and final checkpoints
    (`samebits.runs.across.AcrossResult.verdict`), for a summary or a certificate alike."""
    checks = {f"layout {name!r}": check for name, check in (data.get("checks") or {}).items() if check is not None}
    resumed = (data.get("resume_across") or {}).get("checks") or {}
    checks.update({f"resume {name!r}": check for name, check in resumed.items() if check is not None})
    verdicts = {where: _check_verdict(check, file, where) for where, check in checks.items()}
    controls = data.get("controls")
    for index, control in enumerate(controls or []):
        if "differs" in control and bool(control["differs"]) != _control_differs(control):
            raise _contradiction(file, f"control {index} ({control.get('run')}) says differs={control['differs']} but "
                                       f"its verdict {control.get('verdict')!r} at step {control.get('first_step')!r} "
                                       "says otherwise")
    failed = [c.get("run") for c in controls or [] if c.get("verdict") != "incomplete" and not _control_differs(c)]
    equal = data.get("checkpoints_equal")
    if "checkpoints" in data:  # re-derived from the hashes shown
        derived = _checkpoints_equal(data.get("checkpoints"))
        if equal is True and derived is not True:
            raise _contradiction(file, "checkpoints_equal is true but the checkpoints' hashes shown are not all equal")
        equal = derived if equal is not False else False
    why = ", ".join(f"{where}: {v.value}" for where, v in verdicts.items()) or "no check"
    if failed:
        why += f"; control(s) that did not differ: {', '.join(map(str, failed))}"
    if equal is False:
        why += "; the final checkpoints differ"
    if Verdict.DIVERGED in verdicts.values() or failed or equal is False:
        return Verdict.FAIL, why
    if not verdicts or any(v is not Verdict.IDENTICAL for v in verdicts.values()) or \
            any(c.get("verdict") == "incomplete" for c in controls or []):
        return Verdict.INCOMPLETE, why
    return Verdict.PASS, why


def _verify_report(path: Path, summary: dict, say) -> Report:
    file = path / "summary.json"
    notes: list[str] = []
    derived, why = _verify_verdict(summary, file)
    verdict = _settle(_verdict(summary.get("verdict"), file), derived, file, why, notes)
    page = _Page("verify", f"samebits verify: {path}", verdict)
    page.notes.extend(notes)
    page.conclusion = verify_conclusion(summary)
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
    page.verify_summary(summary, pairs)
    for pair in sorted(pairs, key=lambda p: p.verdict is Verdict.IDENTICAL):  # what failed comes first
        page.pair_sections(pair)
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _across_report(path: Path, summary: dict) -> Report:
    """`verify --across`: layouts of different world sizes, compared with the first by global
    digest (or, for runs without global records, rank 0's replicated records), not rank by
    rank, so the verdicts are shown as verify found them; then its certificate.json (the
    environment, each step's global root per layout, the checkpoints, the invariant reductions,
    the negative controls)."""
    file = path / "summary.json"
    notes: list[str] = []
    claimed = _verdict(summary.get("verdict"), file)
    derived, why = _across_verdict(summary, file)
    verdict = _settle(claimed, derived, file, why, notes)
    certificate = _certificate(path) if "layouts" in summary else None
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
    page = _Page("verify --across", f"samebits verify --across: {path}", verdict)
    page.notes.extend(notes)
    if "layouts" not in summary:  # written before 2026-12: dp sizes, rank 0's replicated records
        page.verify_summary(summary, [])
        page.notes.append(f"runs of different data-parallel sizes ({', '.join(map(str, summary.get('sizes') or []))}) "
                          f"are compared by the replicated records of rank 0 against {summary.get('reference')}, not "
                          "rank by rank: no heatmap or environment comparison is drawn for them")
        return page.finish([str(path)], [], notes=list(summary.get("notes") or []))
    page.conclusion = across_conclusion(summary)
    page.across_summary(summary)
    if certificate is None:
        page.notes.append(f"no certificate.json in {path}: the roots, checkpoints and reductions are not shown")
    else:
        page.across_certificate(certificate)
    page.notes.append("layouts of different world sizes are compared by global tensor, not rank by rank: no heatmap "
                      "or environment comparison is drawn for them")
    return page.finish([str(path)], [], notes=list(summary.get("notes") or []))


def _stopped_report(path: Path, summary: dict) -> Report:
    """A command that did not finish (`samebits.runs._launch.write_stopped`): what stopped it and
    the runs that had ended; no verdict on the runs (exit 3)."""
    file = path / "summary.json"
    _check_fields(summary, {"stopped": _Required(str), "runs": [{"name": str, "command": str, "ended": str}]},
                  file, "")
    page = _Page("stopped", f"samebits: {path} (stopped)", Verdict.INCOMPLETE)
    page.stopped = summary["stopped"]
    page.conclusion = f"STOPPED: {summary['stopped']}; nothing was compared."
    page.h2("Runs that had ended", "runs")
    runs = summary.get("runs") or []
    page.add(_table(["run", "exit", "ended", "seconds", "command"],
                    [[r.get("name"), r.get("exit_code"), r.get("ended"), r.get("seconds"), r.get("command")]
                     for r in runs]) if runs else "<p>none</p>")
    return page.finish([str(path)], [])


def _certificate(path: Path) -> dict | None:
    """``path``/certificate.json checked field by field (`_CERTIFICATE`), or None when there is
    none; `ConfigError` naming the file and the field otherwise (as for summary.json)."""
    file = path / "certificate.json"
    data = _json_file(file, "the certificate `samebits verify --across` writes")
    if data is not None:
        _check_fields(data, _CERTIFICATE, file, "")
    return data


def _bisect_report(path: Path, summary: dict, say) -> Report:
    verdict = _verdict(summary.get("verdict"), path / "summary.json")
    page = _Page("bisect", f"samebits bisect: {path}", verdict)
    page.conclusion = bisect_conclusion(summary)
    page.bisect_summary(summary)
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
        page.pair_sections(pair)
    else:
        page.notes.append("no stage run directories (NN-stage/a, NN-stage/b) were found beside summary.json: "
                          "the heatmap and curves need the streams")
    return page.finish([str(path)], pairs, notes=list(summary.get("notes") or []))


def _matrix_verdict(summary: dict, file: Path) -> tuple[Verdict, str]:
    """matrix's verdict from its cells and failures (`samebits.runs.matrix.MatrixResult.verdict`),
    each cell's verdict held to its checks (PASS: none diverged or undecided; FAIL: one diverged)."""
    cells = summary.get("cells") or []
    verdicts = []
    for index, cell in enumerate(cells):
        where = f"cell {index} ({cell.get('cell')} {cell.get('precision')})"
        verdict = _verdict(cell.get("verdict"), file)
        checks = [cell.get(name) for name in ("repeatable", "resume") if cell.get(name) is not None]
        if verdict is Verdict.PASS and any(check in ("no", "?") for check in checks):
            raise _contradiction(file, f"{where} says 'pass' but a check of it diverged or could not decide")
        if verdict is Verdict.FAIL and checks and "no" not in checks:
            raise _contradiction(file, f"{where} says 'fail' but none of its checks diverged")
        verdicts.append(verdict)
    failures = list(summary.get("failures") or [])
    why = f"{len(cells)} cell(s): " + ", ".join(v.value for v in verdicts) + (f"; failures: {failures[0]}"
                                                                              if failures else "")
    if Verdict.FAIL in verdicts or failures:
        return Verdict.FAIL, why
    if Verdict.PASS not in verdicts:
        return Verdict.INCOMPLETE, why
    return Verdict.PASS, why


def _matrix_report(path: Path, summary: dict, say) -> Report:
    file = path / "summary.json"
    notes: list[str] = []
    derived, why = _matrix_verdict(summary, file)
    verdict = _settle(_verdict(summary.get("verdict"), file), derived, file, why, notes)
    page = _Page("matrix", f"samebits matrix: {path}", verdict)
    page.notes.extend(notes)
    page.conclusion = matrix_conclusion(summary)
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
                            cell_out / other, start, False, say, f"[{len(pairs) + 1}]",
                            names=_verify_names(other, start))
            if name == "resume" and (cell_out / "b").is_dir():
                pair.independent = str(cell_out / "b")  # census records that differ A to B too are left out
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


def _verify_names(other: str, resume_at: int | None) -> tuple[str, str]:
    """What the legends call verify's runs: A against B (independent) or C (resumed)."""
    if other == "c":
        return "run A", f"run C (resumed at step {resume_at})" if resume_at is not None else "run C (resumed)"
    return "run A", "run B"


def _short_path(path: Path) -> str:
    """A run directory as a legend names it: its last two path components."""
    return "/".join(path.parts[-2:]) or str(path)


def _compare(label: str, a: Path, b: Path, start_step: int | None, allow_config_diff: bool, say,
             counter: str, names: tuple[str, str] | None = None) -> Pair:
    """Compare two runs and read what the page draws from their streams."""
    pair = Pair(label, str(a), str(b), start_step)
    pair.names = names or (_short_path(a), _short_path(b))
    stop = read_stop(b)
    if stop is not None and isinstance(stop.get("stopped_at"), int):
        pair.stopped_b = stop["stopped_at"]
    began = time.perf_counter()
    say(f"{counter} comparing {label} ...")
    try:
        pair.result = diff(a, b, start_step=start_step, allow_config_diff=allow_config_diff)
    except (IncomparableRunsError, StreamError) as err:
        pair.error = str(err)
        say(f"      could not compare: {pair.error.splitlines()[0]}")
    chosen = diff_window(pair.result.to_dict()) if pair.result is not None and start_step is None else None
    if chosen is not None:  # b resumed a: diff compared from b's first step; every drawing uses that window
        pair.start_step = chosen[0]
    pair.window = window_words(chosen, pair.start_step)
    if pair.result is not None:
        pair.notes.extend(f"{label}: {note}" for note in pair.result.notes)  # what `samebits diff` says under it
    run_a, run_b = open_run(a), open_run(b)
    try:
        pair.headers = (run_a.header, run_b.header)
        pair.num_ranks = len(set(run_a.ranks) | set(run_b.ranks))
        for run, steps in ((run_a, pair.steps_a), (run_b, pair.steps_b)):
            for rank in run.ranks[:MAX_READ_RANKS]:
                steps[rank] = _steps(run, rank)
        if pair.result is not None and pair.result.verdict is Verdict.DIVERGED:
            for found in divergent_steps(run_a, run_b, start_step=pair.start_step):  # diff's window
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
h3{font-size:15px;margin:14px 0 4px}code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12.5px}
table{border-collapse:collapse;margin:6px 0 10px}td,th{border:1px solid #d5dbe1;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f1f4f7}.verdict{display:inline-block;padding:3px 10px;border-radius:4px;font-weight:700;color:#fff}
.v-pass,.v-identical{background:#1a7f37}.v-fail,.v-diverged{background:#c62828}.v-incomplete{background:#9a6700}
.conclusion{font-size:17px;line-height:1.5;padding:10px 14px;margin:10px 0;border-left:6px solid #8c959f;background:#f6f8fa;overflow-wrap:anywhere}
.conclusion.v-fail,.conclusion.v-diverged{border-color:#c62828;background:#fdf0f0}.conclusion.v-pass,.conclusion.v-identical{border-color:#1a7f37;background:#eefbf1}
.conclusion.v-incomplete{border-color:#9a6700;background:#fff8e5}
.note{color:#57606a}.err{color:#c62828;white-space:pre-wrap}.wrap{overflow-wrap:anywhere;white-space:normal}.small{font-size:11.5px}
table.heat{width:100%;table-layout:fixed;border-collapse:separate;border-spacing:1px}table.heat col.row{width:170px}
table.heat td{height:18px;padding:0;border:0;min-width:3px}table.heat th{font-weight:400;font-size:11px;padding:0 2px;border:0;background:none;overflow:hidden;white-space:nowrap}
table.heat th.row{text-align:right;padding-right:6px;overflow:hidden;text-overflow:ellipsis}
td.h-same{background:#8fd19e}td.h-first{background:#a40e26}td.h-differs{background:#f06b6b}td.h-after{background:#f5b7b1}td.h-missing{background:#d4a72c}
td.h-none{background:#eef1f4}td.h-outside{background:#d0d7de}td.h-cut{background:repeating-linear-gradient(135deg,#d0d7de 0 3px,#f6f8fa 3px 6px)}
.legend span{display:inline-block;width:14px;height:12px;margin:0 5px 0 14px;vertical-align:middle;border-radius:2px}
.legend svg{vertical-align:middle;margin:0 4px 0 12px}
table.records{width:100%;table-layout:fixed;font-size:12px}table.records col.rec{width:260px}
table.records th.rec{overflow-wrap:anywhere;font-weight:400}table.records td{padding:2px 3px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
td.t-eq{color:#1a7f37;text-align:center}td.t-ne{background:#fbe3e3;color:#8b1a1a;text-align:center}td.t-miss{background:#fff1c2;text-align:center}
.charts{display:grid;grid-template-columns:1fr 1fr;gap:6px 22px}.chart-box h3 .note{font-weight:400;margin-left:8px}
.chart,.ulp-plot{display:block;margin:4px 0 6px}
"""


class _Page:
    def __init__(self, kind: str, title: str, verdict: Verdict):
        self.kind, self.title, self.verdict = kind, title, verdict
        self.conclusion = ""  # the sentence the terminal printed (`samebits.runs.conclusion`): the page leads with it
        self.parts: list[str] = []
        self.sections: list[str] = []
        self.notes: list[str] = []
        self.stopped = ""  # a command that did not finish: why

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
        lead = (f'<p class="conclusion v-{self.verdict.value}" id="conclusion">{_esc(self.conclusion)}</p>'
                if self.conclusion else "")
        head = (f'<h1>{_esc(self.title)}</h1>{lead}<p>verdict: <span class="verdict v-{self.verdict.value}" '
                f'id="verdict">{_esc("STOPPED" if self.stopped else self.verdict.value.upper())}</span> '
                f'<span class="note">({_esc(self.kind)}; exit code {EXIT_STOPPED if self.stopped else self.verdict.exit_code})</span></p>'
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
                      html=page, pairs=pairs, notes=notes, conclusion=self.conclusion, stopped=self.stopped)

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

    def across_summary(self, summary: dict) -> None:
        self.h2("Verdicts", "verdicts")
        reference = summary.get("reference")
        rows = []
        for name, check in (summary.get("checks") or {}).items():
            rows.append([f"{reference} = {name}", check.get("verdict"), check.get("by"),
                         (check.get("compared") or {}).get("steps"), _layout_check_where(check)])
        self.add(_table(["layouts", "verdict", "compared by", "steps", "first divergence"], rows, verdict_column=1))
        resumed = summary.get("resume_across")
        if resumed:
            self.h2("Resume across layouts", "resume-across")
            rows = []
            for name, check in (resumed.get("checks") or {}).items():
                rows.append([f"resume-{name}", check.get("verdict"), (check.get("compared") or {}).get("steps"),
                             _layout_check_where(check)])
            self.add(f"<p>{_esc(resumed.get('from'))} saved its checkpoint of step {_esc(resumed.get('step'))}; each "
                     "other layout resumed it (--allow-layout-change) and must equal its uninterrupted run bit for "
                     "bit from there to the end (global digests at every step, rank 0's metrics).</p>"
                     + _table(["run", "verdict", "steps", "first divergence"], rows, verdict_column=1))
        controls = summary.get("controls")
        self.h2("Negative controls", "controls")
        if controls is None:
            self.add(f"<p>{_esc(summary.get('controls_note') or 'not run')}</p>")
        else:
            self.add("<p>each layout without the switches, against the reference without them, on the same global "
                     "batch: each must differ at step 0 or 1, or the comparison cannot tell layouts apart.</p>"
                     + _table(["control", "differs", "first step", "verdict", "detail"],
                              [[c.get("run"), "yes" if c.get("differs") else "NO", c.get("first_step"),
                                c.get("verdict"), c.get("detail")] for c in controls], verdict_column=3))
        runs = summary.get("runs") or []
        if runs:
            self.add("<h3>Runs</h3>" + _table(["run", "exit", "seconds", "command"],
                                             [[r.get("name"), r.get("exit_code"), r.get("seconds"), r.get("command")]
                                              for r in runs]))

    def across_certificate(self, cert: dict) -> None:
        self.h2("Certificate", "certificate")
        env = cert.get("environment") or {}
        self.add("<h3>Environment</h3>" + _table(["", ""], [[k, v] for k, v in env.items()]))
        layouts = cert.get("layouts") or []
        self.add("<h3>Layouts</h3>" + _table(["cell", "world size", "overrides", "command"],
                                            [[l.get("cell"), l.get("world_size"), " ".join(l.get("overrides") or []),
                                              l.get("command")] for l in layouts]))
        roots = cert.get("roots") or {}
        steps = [str(s) for s in cert.get("steps") or []]
        names = list(roots)
        self.add("<h3>Global root per step</h3>")
        if names and steps and cert.get("roots_equal"):
            first = roots[names[0]]
            self.add(f"<p>every layout ({_esc(', '.join(names))}) holds the same global root at every step "
                     f"({len(steps)} steps), collapsed into one column:</p>"
                     + _table(["step", "global root (all layouts)"], [[s, first.get(s)] for s in steps]))
        else:
            self.add(_table(["step", *names], [[s, *[roots[n].get(s, "(missing)") for n in names]] for s in steps]))
        checkpoints = cert.get("checkpoints") or {}
        self.add("<h3>Checkpoints</h3>")
        if checkpoints:
            equal = {True: "every layout's final checkpoint holds the same training state (content hashes equal)",
                     False: "the final checkpoints' content hashes DIFFER: the saved training state is not the same",
                     None: "the final checkpoints' content hashes were not all computed"}[cert.get("checkpoints_equal")]
            self.add(f"<p>{_esc(equal)}</p>" + _table(
                ["layout", "step", "content sha256", "files", "files sha256"],
                [[n, c.get("step"), c.get("content_sha256") or c.get("content_error") or "-", c.get("files"),
                  c.get("files_sha256") or c.get("sha256")] for n, c in checkpoints.items()])
                     + f"<p class=\"note\">{_esc(cert.get('checkpoints_note') or '')}</p>")
        else:
            self.add("<p>no checkpoint saved (a command, or runs of one step)</p>")
        reductions = cert.get("invariant_reductions") or []
        self.add("<h3>Invariant reductions</h3>" + (
            _table(["switch", "size", "covers"], [[r.get("switch"), r.get("size"), r.get("covers")] for r in reductions])
            if reductions else "<p>none listed (one rank only, or a command: its own)</p>"))

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
        for c in cells:  # what the terminal printed under the table: the census, then the bisection
            where = f"{c.get('cell')} {c.get('precision')}"
            for check, lines in (c.get("explanations") or {}).items():
                self.add(f"<h3>{_esc(where)}, {_esc(check)}: what differs (most specific first)</h3><ul>"
                         + "".join(f"<li>{_esc(line)}</li>" for line in lines) + "</ul>")
            found = c.get("bisect")
            if found:
                of = " of the resume" if found.get("of") == "resume" else ""
                said = found.get("conclusion") or found.get("error")
                self.add(f"<h3>{_esc(where)}, bisect{_esc(of)}</h3><p><b>{_esc(said)}</b></p>"
                         + (f"<p class=\"note\">streams and summary: <code>{_esc(found.get('out'))}</code></p>"
                            if found.get("out") else ""))

    # -- one compared pair --------------------------------------------------------------------

    def pair_sections(self, pair: Pair) -> None:
        self.h2(f"{pair.label}: {pair.verdict.value}", f"pair-{pair.label}")
        self.add(f'<p>a = {_esc(pair.names[0])}: <code>{_esc(pair.a)}</code><br>b = {_esc(pair.names[1])}: '
                 f'<code>{_esc(pair.b)}</code>' + (f'<br><span class="window">{_esc(pair.window)}</span>'
                                                   if pair.window else "") + "</p>"
                 f'<p class="pair-conclusion"><b>{_esc(pair.conclusion)}</b></p>')
        if pair.stopped_b is not None:
            self.add(f'<p class="note">the live check stopped {_esc(pair.names[1])} at step {pair.stopped_b}, its '
                     "first step that differs from a: later steps were not run (run verify with --keep-going to "
                     "see the whole divergent curves)</p>")
        result = pair.result
        rank = _focus_rank(pair)
        if result is None:
            self.add(f'<p class="err">could not compare: {_esc(pair.error)}</p>')
        else:
            self._diff_summary(result, pair.context)
        if result is not None and result.verdict is Verdict.IDENTICAL:  # nothing grows, nothing parts
            self._heatmap(pair)
            self._environment(pair, facts=False)
            return
        resumed = bool(pair.start_step)  # a resume's failure is explained by its state: that picture first
        if result is not None and resumed:
            self._census(pair, rank)
        if result is not None:
            self._ulp_growth(pair, rank)
        self._curves(pair, rank)
        if result is not None and not resumed:
            self._census(pair, rank)
        if result is not None:
            self._heatmap(pair)
            self._tensors(pair)
        self._environment(pair)

    def _diff_summary(self, result: DiffResult, context: str = "") -> None:
        c = result.compared
        self.add(f'<p>verdict: <span class="verdict v-{result.verdict.value}">{_esc(result.verdict.value.upper())}'
                 f"</span> {_esc(c.get('ranks'))} rank(s) x {_esc(c.get('steps'))} step(s), {_esc(c.get('records'))} "
                 + ("records compared before the first divergence</p>" if result.first_divergence is not None
                    else "records compared</p>"))
        d = result.first_divergence
        if d is not None:
            where = f"{d.phase}/{d.name}" if d.name is not None else d.detail
            said = f"{context}: " if context else "first divergence: "
            self.add(f"<p><b>{_esc(said)}step {_esc(d.step)}, rank {_esc(d.rank)}: {_esc(where)}</b> "
                     f"({_esc(d.records_differing)} record(s) differ in that step; ranks diverged first: "
                     f"{_esc(', '.join(map(str, result.ranks_diverged_first)))})</p>"
                     f"<p class=\"mono wrap\">{_esc(d.detail)}</p>")
        for reason in result.incomplete:
            self.add(f'<p class="err">incomplete: {_esc(reason)}</p>')

    def _census(self, pair: Pair, rank: int) -> None:
        """The training state at each step start (the state census), b against a: for each
        record that differs, the step of a whose state b holds (`state_positions`), drawn; the
        records equal throughout and those left out (with why) listed under it."""
        picture = state_positions(pair.a, pair.b, rank, pair.start_step or 0, independent=pair.independent)
        if picture is None:  # no census stream (a loop that records none): nothing to draw, nothing to say
            return
        label_a, label_b = _short_names(pair)
        pair.census_summary = {"says": [t.says(label_a, label_b) for t in picture.tracks], **picture.to_dict()}
        if not picture.tracks and not picture.left_out:
            return  # the state was the same throughout: the other sections say where the runs part
        self.h2(f"{pair.label}: the training state, step by step (rank {rank})", "census")
        self.add(f"<p>At each step start the state census records the bits of every generator, the optimizer's "
                 f"step counts and learning rates, the LR scheduler's position and the step's input batch (the "
                 f"data position). They are digests, so each chart places {_esc(label_b)}'s state at the step of "
                 f"{_esc(label_a)} that holds the same bits: on the diagonal, {_esc(label_b)} holds "
                 f"{_esc(label_a)}'s state of that very step; below it, {_esc(label_a)}'s of an earlier step (not "
                 f"restored, or restored from another step); a cross in the top band: no step of "
                 f"{_esc(label_a)} holds it. Generators carry ticks for the steps in which each run drew from "
                 "them.</p>")
        if pair.stopped_b is not None:  # one or two points a chart: say how to see where the state goes on
            self.add(f'<p class="note" id="census-cut">{_esc(label_b)} was stopped at step {pair.stopped_b} by the '
                     f"live check (its first step whose records differ from {_esc(label_a)}'s), so the charts end there: "
                     "<code>samebits verify --keep-going</code> runs it to the end and draws where its state goes "
                     "after.</p>")
        if picture.tracks:
            charts = [_state_chart(track, picture, pair, label_a, label_b)
                      for track in picture.tracks[:MAX_STATE_CHARTS]]
            self.add('<ul id="census-says">' + "".join(f"<li>{_esc(t.says(label_a, label_b))}</li>"
                                                        for t in picture.tracks) + "</ul>")
            self.add('<div class="charts" id="census-plot">' + "".join(charts) + "</div>")
            if len(picture.tracks) > MAX_STATE_CHARTS:
                self.add(f"<p class=\"note\">{len(picture.tracks) - MAX_STATE_CHARTS} more differing record(s) "
                         "listed above, not drawn</p>")
        else:
            self.add(f"<p>no state record that could explain the difference differs between {_esc(label_a)} and "
                     f"{_esc(label_b)} at a step start.</p>")
        lines = []
        if picture.same:
            lines.append(f"the same in both runs at every compared step: {', '.join(picture.same)}")
        lines.extend(f"left out: {title}: {why}" for title, why in picture.left_out)
        if lines:
            self.add('<ul class="note" id="census-notes">' + "".join(f"<li>{_esc(x)}</li>" for x in lines)
                     + "</ul>")

    def _ulp_growth(self, pair: Pair, rank: int) -> None:
        """How far apart the runs are at each step: the largest ulp distance per metric (log
        scale), and for the digest-only tensor groups the steps where they differ."""
        self.h2(f"{pair.label}: ulp growth (rank {rank})", "ulps")
        try:
            evidence = pair.view(rank).evidence
        except StreamError as err:
            self.add(f'<p class="err">the records could not be read: {_esc(err)}</p>')
            return
        if not evidence:
            self.add("<p>no step recorded in both runs on this rank.</p>")
            return
        first = pair.result.first_divergence if pair.result is not None else None
        first_step = first.step if first is not None and first.rank == rank else \
            pair.first_by_rank.get(rank, (None, None))[0]
        self.add("<p>the largest distance between a and b in units in the last place (ulps) at each step, per "
                 "metric, exact from the recorded bits, on a log scale (0: the same bits). Tensors are recorded "
                 "as digests: for params, grads and optimizer state the bands under the plot mark the steps where "
                 "they differ, with no magnitude (<b>values not recorded</b>).</p>")
        self.add(_ulp_plot(pair, rank, evidence, first_step))

    def _heatmap(self, pair: Pair) -> None:
        self.h2(f"{pair.label}: where the runs differ, step by step", "heat")
        ranks = sorted(set(pair.steps_a) | set(pair.steps_b))
        steps = sorted({s for steps in list(pair.steps_a.values()) + list(pair.steps_b.values()) for s in steps})
        if not ranks or not steps:
            self.add("<p>no steps recorded</p>")
            return
        columns = _bins(steps, MAX_STEPS)
        if pair.num_ranks <= 2:
            try:
                rows = _group_rows(pair, ranks, columns)
            except StreamError as err:
                self.add(f'<p class="err">the records could not be read: {_esc(err)}</p>')
                return
            what = "record groups (rows) x steps (columns)"
        else:
            rows = _rank_rows(pair, _bins(ranks, MAX_RANKS), columns)
            what = "ranks (rows) x steps (columns)"
        used = {state for _, cells in rows for state, _ in cells}
        every = max(1, math.ceil(len(columns) / 16))  # a step label every few columns
        header = "".join(f'<th title="step {_span(c)}">{_span(c) if i % every == 0 else ""}</th>'
                         for i, c in enumerate(columns))
        body = []
        for name, cells in rows:
            body.append(f'<tr><th class="row">{_esc(name)}</th>'
                        + "".join(f'<td class="h-{state}" title="{_esc(text)}"></td>' for state, text in cells)
                        + "</tr>")
        legend = "".join(f'<span style="background:{colour}"></span>{_esc(text)}' for state, colour, text in _HEAT
                         if state in used)
        binned = []
        if any(len(c) > 1 for c in columns):
            binned.append(f"{len(steps)} steps in {len(columns)} columns of up to {max(map(len, columns))} steps")
        if pair.num_ranks > 2 and len(rows) < len(ranks):
            binned.append(f"{len(ranks)} ranks in {len(rows)} rows of up to {math.ceil(len(ranks) / len(rows))} "
                          "ranks; a row shows the most telling state of its ranks (hover for the ranks)")
        self.add(f"<p>{_esc(what)}: each cell says whether the runs have the same bits there"
                 + (f" ({_esc('; '.join(binned))})" if binned else "") + "; hover a cell for its detail.</p>"
                 f'<table class="heat" id="heatmap"><colgroup><col class="row"></colgroup><tr><th></th>{header}</tr>'
                 f'{"".join(body)}</table><p class="legend" id="heat-legend">{legend}</p>')
        if pair.first_by_rank:
            listed = sorted(pair.first_by_rank.items())
            by_rank = ", ".join(f"rank {r}: step {s}" for r, (s, _) in listed[:16])
            self.add(f"<p>first divergent step per rank: {_esc(by_rank)}"
                     + (f" ... ({len(listed)} ranks)" if len(listed) > 16 else "")
                     + f"; ranks with no divergence: {len(ranks) - len(listed)} of {len(ranks)}</p>")
        if pair.num_ranks > len(ranks):
            self.add(f"<p class=\"note\">{pair.num_ranks - len(ranks)} rank(s) beyond the first {MAX_READ_RANKS} "
                     "not drawn</p>")

    def _tensors(self, pair: Pair) -> None:
        title = f"{pair.label}: records that differ, by module, step by step"
        self.h2(title, "tensors")
        d = pair.result.first_divergence if pair.result is not None else None
        if d is None:
            self.add("<p>no record differs in the compared window.</p>")
            return
        rank = d.rank
        steps_a, steps_b = set(pair.steps_a.get(rank, [])), set(pair.steps_b.get(rank, []))
        after = sorted(s for s in steps_a | steps_b if s >= d.step)
        both = [s for s in after if s in steps_a and s in steps_b]
        cut = [s for s in after if s not in steps_b and pair.cut(s)]
        lone = [s for s in after if (s in steps_a) != (s in steps_b) and s not in cut]
        wanted = both[:MAX_TENSOR_STEPS]
        try:
            records_a = _records_by_step(pair.a, rank, set(wanted), wanted[-1]) if wanted else {}
            records_b = _records_by_step(pair.b, rank, set(wanted), wanted[-1]) if wanted else {}
        except StreamError as err:  # damaged after the first divergence: the divergence still stands
            self.add(f'<p class="err">the records after the first divergence could not be read: {_esc(err)}</p>')
            return
        differing: dict[tuple, dict[int, tuple[str, str]]] = {}
        present: dict[tuple, set[int]] = {}  # record -> the steps both runs hold it (a module's "of n")
        for step in wanted:
            at_a, at_b = records_a.get(step, {}), records_b.get(step, {})
            for key in list(at_a) + [k for k in at_b if k not in at_a]:
                present.setdefault(key, set()).add(step)
                ra, rb = at_a.get(key), at_b.get(key)
                if ra is not None and rb is not None and ra.same_content(rb):
                    continue
                differing.setdefault(key, {})[step] = _cell(ra, rb, True, True)
        params = {key[2] for step in wanted for at in (records_a.get(step, {}),) for key in at
                  if key[1] in ("params", "grads")}
        rows = _module_rows(differing, present, params)
        shown = rows[:MAX_TENSOR_ROWS]
        rows_html = []
        for row in shown:
            cells = []
            for step in wanted:
                css, text, short = row.cell(step)
                cells.append(f'<td class="{css}" title="{_esc(text)}">{_esc(short)}</td>')
            rows_html.append(f'<tr><th class="mono rec" title="{_esc(row.hover)}">{_esc(row.title)}</th>'
                             f"{''.join(cells)}</tr>")
        head = "".join(f"<th>{s}</th>" for s in wanted)
        self.add(f"<p>rank {rank} (the first to diverge), from step {d.step}: each metric on its own row, with its "
                 "distance in ulps, exact from the recorded bits; the tensors grouped by the module they belong to "
                 "(its parameters, their gradients and optimizer state, its activations), each cell saying how "
                 "many of the module's records differ at that step (= none; hover for which). Tensors are "
                 "<b>digests only: values not recorded</b> (no magnitude is known; `samebits bisect` dumps the "
                 "origin op's elements).</p>"
                 f'<table id="per-tensor" class="records"><colgroup><col class="rec"></colgroup>'
                 f'<tr><th>module \\ step</th>{head}</tr>{"".join(rows_html)}</table>')
        lines = []
        if len(both) > len(wanted):
            lines.append(f"steps {both[len(wanted)]}-{both[-1]} ({len(both) - len(wanted)} more steps run by both) "
                         "are not listed: the ulp growth and the heatmap above show them")
        if cut:
            lines.append(f"steps {_span(cut)}: not run past the first divergence (the live check stopped "
                         f"{pair.names[1]} at step {pair.stopped_b})")
        if lone:
            lines.append(f"steps {_span(lone)}: recorded in one run only")
        if len(rows) > len(shown):
            lines.append(f"{len(rows) - len(shown)} more row(s) of differing records not listed")
        if lines:
            self.add('<ul class="note" id="tensor-notes">' + "".join(f"<li>{_esc(x)}</li>" for x in lines) + "</ul>")

    def _curves(self, pair: Pair, rank: int) -> None:
        try:
            view = pair.view(rank)
            metrics_a, metrics_b = view.metrics_a, view.metrics_b
        except StreamError as err:
            self.add(f"<p class=\"err\">metric curves: {_esc(err)}</p>")
            return
        labels = {n for m in list(metrics_a.values()) + list(metrics_b.values()) for n in m}
        names = sorted(labels, key=lambda n: _metric_sort(_metric_title(n)))
        title = f"{pair.label}: metric curves (rank {rank})"
        self.h2(title, "curves")
        if not names:
            self.add("<p>no metrics recorded (Recorder.metrics) on this rank.</p>")
            return
        first = pair.first_by_rank.get(rank, (None, None))[0]
        self.add(f'<p class="legend" id="curve-legend"><svg width="34" height="10"><line x1="0" y1="5" x2="34" y2="5" '
                 f'stroke="{COLOUR_A}" stroke-width="2.5"/></svg> a: {_esc(pair.names[0])} (solid) '
                 f'<svg width="34" height="10"><line x1="0" y1="5" x2="34" y2="5" stroke="{COLOUR_B}" '
                 f'stroke-width="2.5" {_DASHED}/></svg> b: {_esc(pair.names[1])} (dashed) '
                 '<svg width="10" height="10"><circle cx="5" cy="5" r="3.5" fill="#cf222e"/></svg> a step whose '
                 "bits differ</p>")
        charts = [_chart(name, {s: m[name] for s, m in metrics_a.items() if name in m},
                         {s: m[name] for s, m in metrics_b.items() if name in m}, pair, first)
                  for name in names[:MAX_CURVES]]
        self.add('<div class="charts">' + "".join(charts) + "</div>")
        if len(names) > MAX_CURVES:
            self.add(f"<p class=\"note\">{len(names) - MAX_CURVES} more metric(s) not drawn</p>")

    def _environment(self, pair: Pair, facts: bool = True) -> None:
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
        rows = [[k, env.get(k)] for k in ("torch", "python", "platform", "hostname", "num_threads", "cuda",
                                          "device", "deterministic_algorithms") if k in env]
        if rows and facts:
            self.add("<h3>run a</h3>" + _table(["", "value"], rows))


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


_DASHED = 'stroke-dasharray="7,4"'
# Heatmap states, most telling first (a binned cell shows the first of its members'): the colour
# and what the legend says.
_HEAT = (("first", "#a40e26", "first divergence"), ("differs", "#f06b6b", "differs"),
         ("after", "#f5b7b1", "after this rank's first divergence (not compared further)"),
         ("cut", "repeating-linear-gradient(135deg,#d0d7de 0 3px,#f6f8fa 3px 6px)",
          "not run past the first divergence (live check)"),
         ("missing", "#d4a72c", "in one run only"), ("same", "#8fd19e", "identical"),
         ("outside", "#d0d7de", "outside the compared window"), ("none", "#eef1f4", "not recorded"))
_RANK = {state: index for index, (state, _, _) in enumerate(_HEAT)}


@dataclass
class _GroupStep:
    """One record group (a metric, or a phase of tensors) at one step of one rank."""

    kind: str  # "metric" | "tensor"
    records: int = 0
    differ: int = 0
    missing: int = 0  # records in one run only
    max_ulp: int | None = None  # float metrics: the largest ulp distance (0 when the bits are the same)


def _metric_title(label: str) -> str:
    """What a person calls a recorded metric (``backward/root`` is the loss)."""
    if label in _METRIC_NAMES:
        return _METRIC_NAMES[label]
    phase, _, name = label.partition("/")
    return name.replace("_", " ") if phase == "metrics" and name else label


def _metric_sort(title: str) -> tuple:
    return (_METRIC_ORDER.index(title) if title in _METRIC_ORDER else len(_METRIC_ORDER), title)


def _group_of(record: Record) -> tuple[str, str]:
    """A record's group and its kind: each metric is its own group, tensors group by phase."""
    if record.kind == "metric":
        return _metric_title(_key_label(record.key)), "metric"
    return _GROUP_NAMES.get(record.phase, record.phase), "tensor"


def _group_sort(item: tuple[str, str]) -> tuple:
    name, kind = item
    if kind == "metric":
        return (0,) + _metric_sort(name)
    return (1, _GROUP_ORDER.index(name) if name in _GROUP_ORDER else len(_GROUP_ORDER), name)


def _focus_rank(pair: Pair) -> int:
    """The rank the ulp plot, curves and records table show: the first to diverge, else the first."""
    if pair.result is not None and pair.result.first_divergence is not None:
        return pair.result.first_divergence.rank
    ranks = sorted(set(pair.steps_a) | set(pair.steps_b))
    return ranks[0] if ranks else 0


@dataclass
class _RankView:
    """What the plots draw of one rank: ``evidence`` (per step recorded by both runs inside the
    compared window, per record group, `_GroupStep`) and each run's metric records per step."""

    evidence: dict[int, dict[tuple[str, str], _GroupStep]] = field(default_factory=dict)
    metrics_a: dict[int, dict[str, Record]] = field(default_factory=dict)
    metrics_b: dict[int, dict[str, Record]] = field(default_factory=dict)


def _read_rank(pair: Pair, rank: int) -> _RankView:
    """One pass over both runs' streams of ``rank``, step by step in step order: each step's
    records are summarised (`_evidence_of`) and dropped, only the metrics are kept, so a long run
    with large steps costs the memory of its summaries."""
    view = _RankView()
    start = pair.start_step or 0
    run_a, run_b = open_run(pair.a), open_run(pair.b)
    readers = [run.stream(rank) for run in (run_a, run_b) if rank in run.files]
    try:
        if len(readers) < 2:
            return view
        blocks_a, blocks_b = readers[0].steps(), readers[1].steps()
        block_a, block_b = next(blocks_a, None), next(blocks_b, None)
        while block_a is not None or block_b is not None:
            step = min(block.step for block in (block_a, block_b) if block is not None)
            at_a = {r.key: r for r in block_a.records()} if block_a is not None and block_a.step == step else None
            at_b = {r.key: r for r in block_b.records()} if block_b is not None and block_b.step == step else None
            for found, records in ((view.metrics_a, at_a), (view.metrics_b, at_b)):
                metrics = {_key_label(key): r for key, r in (records or {}).items() if r.kind == "metric"}
                if metrics:
                    found[step] = metrics
            if at_a is not None and at_b is not None and step >= start:
                view.evidence[step] = _evidence_of(at_a, at_b)
            if at_a is not None:
                block_a = next(blocks_a, None)
            if at_b is not None:
                block_b = next(blocks_b, None)
    finally:
        for reader in readers:
            reader.close()
        run_a.close()
        run_b.close()
    return view


def _evidence_of(at_a: dict[tuple, Record], at_b: dict[tuple, Record]) -> dict[tuple[str, str], _GroupStep]:
    """One step of both runs, per record group: how many records, how many differ or are in one
    run only, and the largest ulp distance of a float metric (exact, from the bits)."""
    groups: dict[tuple[str, str], _GroupStep] = {}
    for key in list(at_a) + [k for k in at_b if k not in at_a]:
        ra, rb = at_a.get(key), at_b.get(key)
        name, kind = _group_of(ra or rb)
        cell = groups.setdefault((name, kind), _GroupStep(kind))
        cell.records += 1
        if ra is None or rb is None:
            cell.missing += 1
            continue
        same = ra.same_content(rb)
        if not same:
            cell.differ += 1
        if kind == "metric":
            ulp = 0 if same else metric_distance(ra, rb)[0]
            if ulp is not None:
                cell.max_ulp = ulp if cell.max_ulp is None else max(cell.max_ulp, ulp)
    return groups


def _bins(items: list[int], most: int) -> list[list[int]]:
    """``items`` in at most ``most`` consecutive runs of equal size (the last may be shorter)."""
    size = max(1, math.ceil(len(items) / most))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _span(steps: list[int]) -> str:
    return f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"


def _rank_state(pair: Pair, rank: int, step: int) -> tuple[str, str]:
    """One rank at one step: its state on the heatmap and what it says."""
    in_a, in_b = pair.ran("a", rank, step), pair.ran("b", rank, step)
    first = pair.first_by_rank.get(rank)
    if step < (pair.start_step or 0):
        return "outside", "before the compared window"
    if first is not None and step == first[0]:
        return "first", "first divergence" + (f" (run {first[1]} has no such step)" if first[1] else "")
    if in_a and not in_b and pair.cut(step):
        return "cut", f"not run past the first divergence (the live check stopped {pair.names[1]} at step " \
                      f"{pair.stopped_b})"
    if first is not None and step > first[0]:
        return "after", "after this rank's first divergence"
    if in_a and in_b:
        return "same", "identical"
    if in_a or in_b:
        return "missing", f"only in run {'a' if in_a else 'b'}"
    return "none", "not recorded"


def _rank_rows(pair: Pair, rows: list[list[int]], columns: list[list[int]]) -> list[tuple[str, list]]:
    """Ranks x steps; a binned cell takes its members' most telling state."""
    out = []
    for ranks in rows:
        name = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        cells = []
        for steps in columns:
            states = [(_rank_state(pair, rank, step), rank) for rank in ranks for step in steps]
            (state, text), _ = min(states, key=lambda found: _RANK[found[0][0]])
            if len(states) == 1:
                cells.append((state, f"rank {ranks[0]}, step {steps[0]}: {text}"))
                continue
            count = sum(1 for (s, _), _ in states if s == state)
            where = f"{name}, steps {_span(steps)}" if len(steps) > 1 else f"{name}, step {steps[0]}"
            members = sorted({rank for (s, _), rank in states if s == state})
            cells.append((state, f"{where}: {text} ({count} of {len(states)} rank-steps; ranks "
                                 f"{', '.join(map(str, members[:8]))}{' ...' if len(members) > 8 else ''})"))
        out.append((name, cells))
    return out


def _group_rows(pair: Pair, ranks: list[int], columns: list[list[int]]) -> list[tuple[str, list]]:
    """Record groups x steps, for one or two ranks: where each group differs, step by step."""
    out = []
    for rank in ranks:
        evidence = pair.view(rank).evidence
        groups = sorted({g for at in evidence.values() for g in at}, key=_group_sort)[:MAX_GROUP_ROWS]
        first_step = pair.first_by_rank.get(rank, (None, None))[0]  # this rank's own first divergence
        for group in groups:
            name = f"rank {rank}: {group[0]}" if len(ranks) > 1 else group[0]
            cells = []
            for steps in columns:
                states = [_group_state(pair, rank, step, evidence.get(step, {}).get(group), step == first_step)
                          for step in steps]
                state, text = min(states, key=lambda found: _RANK[found[0]])
                where = f"step {steps[0]}" if len(steps) == 1 else f"steps {_span(steps)}"
                cells.append((state, f"{name}, {where}: {text}"))
            out.append((name, cells))
    return out


def _group_state(pair: Pair, rank: int, step: int, cell: _GroupStep | None, first: bool) -> tuple[str, str]:
    if step < (pair.start_step or 0):
        return "outside", "before the compared window"
    if cell is None:
        state, text = _rank_state(pair, rank, step)
        return ("none", "not recorded at this step") if state in ("same", "after", "first") else (state, text)
    if cell.differ:
        how = f"{cell.differ} of {cell.records} record(s) differ"
        if cell.max_ulp is not None:
            how += f", {cell.max_ulp} ulp"
        elif cell.kind == "tensor":
            how += " (digests: values not recorded)"
        return ("first", "first divergence: " + how) if first else ("differs", how)
    if cell.missing:
        return "missing", f"{cell.missing} of {cell.records} record(s) in one run only"
    return "same", f"identical ({cell.records} record(s))"


def _short(text: str) -> str:
    """A records-table cell: the ulps of a metric, or one word (the whole text on hover)."""
    if " ulp" in text:
        ulp = int(text.split(" ulp")[0])
        return f"{ulp} ulp" if ulp < 10_000 else f"{ulp:.1e} ulp".replace("e+0", "e").replace("e+", "e")
    return {"digest differs": "digest"}.get(text, "only a" if text.endswith("run a") else
                                            "only b" if text.endswith("run b") else "differs")


@dataclass
class _ModuleRow:
    """One row of the records table: a metric (its own cells, with ulps) or a module (its
    tensor records together: how many differ at each step, which on hover)."""

    title: str
    hover: str
    differing: dict[int, list[tuple[str, str, str]]]  # step -> [(record, css class, how it differs)]
    records: dict[int, int]  # step -> the module's records both runs hold there
    metric: bool = False

    def cell(self, step: int) -> tuple[str, str, str]:
        """(css class, hover text, cell text) at ``step``."""
        found = self.differing.get(step)
        if not found:
            return "t-eq", "bit-identical", "="
        if self.metric:
            _, css, how = found[0]
            return css, how, _short(how)
        count = self.records.get(step) or len(found)
        return ("t-ne", f"{len(found)} of {count} record(s) differ: "
                + "; ".join(f"{name} ({how})" for name, _, how in found), f"{len(found)} of {count}")

    @property
    def first(self) -> int:
        return min(self.differing)


def _module_of(key: tuple, params: set[str]) -> str:
    """The module a tensor record belongs to: a parameter's or gradient's owner (``fc`` of
    ``fc.weight``), the parameter an optimizer state belongs to (``fc.weight.exp_avg``), the
    module whose output or input it is (``GPT.fc.0``: ``GPT.fc``)."""
    _, phase, name, _ = key
    if phase == "optimizer":
        owner = max((p for p in params if name.startswith(p + ".")), key=len, default=None)
        name = owner if owner is not None else name.rpartition(".")[0] or name
    elif phase not in ("params", "grads"):
        parts = name.split(".")
        while len(parts) > 1 and parts[-1].isdigit():  # output or input index
            parts.pop()
        return ".".join(parts)
    return name.rpartition(".")[0] or "(top level)"


def _module_rows(differing: dict[tuple, dict[int, tuple[str, str]]], present: dict[tuple, set[int]],
                 params: set[str]) -> list[_ModuleRow]:
    """The records table's rows: each differing metric, then each module with a differing tensor
    record, earliest first divergence first (then in record order)."""
    rows: dict[str, _ModuleRow] = {}
    for key, at in differing.items():
        kind, phase, name, _ = key
        if kind == "metric":
            label = _key_label(key)
            title = _metric_title(label)  # what a person calls it (backward/root is the loss), then its record
            rows[f"metric {label}"] = _ModuleRow(title if title == label else f"{title} ({label})", kind, {s: [(label, css, how)] for s, (css, how) in at.items()},
                                                 {}, metric=True)
            continue
        module = _module_of(key, params)
        row = rows.setdefault(f"module {module}", _ModuleRow(module, "", {}, {}))
        for step, (css, how) in at.items():
            row.differing.setdefault(step, []).append((_key_label(key), css, how))
    for key, steps in present.items():  # each module's count of records, step by step
        if key[0] != "metric":
            row = rows.get(f"module {_module_of(key, params)}")
            if row is not None:
                for step in steps:
                    row.records[step] = row.records.get(step, 0) + 1
    for row in rows.values():
        if row.metric:
            continue
        by_group: dict[str, list[str]] = {}  # what differs in the module: group -> its records, leaf names
        for found in row.differing.values():
            for label, _, _ in found:
                phase, _, name = label.partition("/")
                leaf = name[len(row.title) + 1:] if name.startswith(row.title + ".") else name
                names = by_group.setdefault(_GROUP_NAMES.get(phase, phase), [])
                if leaf not in names:
                    names.append(leaf)
        groups = sorted(by_group, key=lambda g: _GROUP_ORDER.index(g) if g in _GROUP_ORDER else len(_GROUP_ORDER))
        said = "; ".join(f"{g}: {', '.join(by_group[g][:MAX_LEAVES])}" + (" ..." if len(by_group[g]) > MAX_LEAVES
                                                                          else "") for g in groups)
        row.hover = f"module {row.title}: " + "; ".join(f"{g}: {', '.join(by_group[g])}" for g in groups)
        row.title = f"{row.title} ({said})"
    return sorted(rows.values(), key=lambda r: (not r.metric, r.first))


def _log_ticks(decades: int) -> list[int]:
    step = max(1, math.ceil(decades / 6))
    return list(range(0, decades + 1, step))


def _ulp_plot(pair: Pair, rank: int, evidence: dict[int, dict[tuple[str, str], _GroupStep]],
              first_step: int | None) -> str:
    """The ulp distance per step per metric on a log axis (0 on its own line below 1), the
    digest-only groups as bands of differing steps, the first divergence and the steps the
    live check cut, as one inline SVG and a legend."""
    steps = sorted(set(evidence) | {s for s in pair.steps_a.get(rank, []) if pair.cut(s)})
    groups = sorted({g for at in evidence.values() for g in at}, key=_group_sort)
    lines = [g for g in groups if g[1] == "metric" and any(at.get(g) is not None and at[g].max_ulp is not None
                                                            for at in evidence.values())]
    bands = [g for g in groups if g not in lines]
    width, left, right, top = 1100, 124, 24, 34
    plot_h, band_h = 210, 18
    bottom_axis = top + plot_h
    height = bottom_axis + 30 + band_h * len(bands) + 8
    low, high = steps[0], steps[-1]
    span = high - low + 1

    def x(step: float) -> float:
        return left + (step - low + 0.5) / span * (width - left - right)

    biggest = max([at[g].max_ulp or 0 for at in evidence.values() for g in lines if g in at] + [1])
    decades = max(1, math.ceil(math.log10(biggest + 0.5)))
    zero_y, one_y = bottom_axis - 6, bottom_axis - 30

    def y(ulp: int) -> float:
        return zero_y if ulp == 0 else one_y - math.log10(ulp) / decades * (one_y - top)

    parts = [f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{plot_h}" fill="#fbfcfd" '
             'stroke="#d0d7de"/>']
    for k in _log_ticks(decades):
        label = f"{10 ** k:,}" if k < 4 else f"1e{k}"
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(10 ** k):.1f}" y2="{y(10 ** k):.1f}" '
                     f'stroke="#e5e9ee"/><text x="{left - 6}" y="{y(10 ** k) + 4:.1f}" text-anchor="end" '
                     f'font-size="12">{label}</text>')
    parts.append(f'<line x1="{left}" x2="{width - right}" y1="{zero_y}" y2="{zero_y}" stroke="#8c959f" '
                 f'stroke-dasharray="2,3"/><text x="{left - 6}" y="{zero_y + 4}" text-anchor="end" font-size="12">'
                 "0</text>")
    parts.append(f'<text x="40" y="{top + plot_h / 2:.0f}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 40 {top + plot_h / 2:.0f})" class="axis-title">ulps (log scale)</text>')
    cut = [s for s in steps if pair.cut(s)]
    if cut:
        x0 = x(cut[0] - 0.5)
        parts.append(f'<rect class="cut" x="{x0:.1f}" y="{top}" width="{width - right - x0:.1f}" '
                     f'height="{height - top - 8}" fill="#eef1f4"><title>not run past the first divergence</title>'
                     f'</rect><text x="{(x0 + width - right) / 2:.0f}" y="{top + plot_h / 2:.0f}" text-anchor="middle" '
                     f'font-size="12" fill="#57606a">{_esc(pair.names[1])}: not run past the first divergence'
                     f'</text><text x="{(x0 + width - right) / 2:.0f}" y="{top + plot_h / 2 + 16:.0f}" '
                     f'text-anchor="middle" font-size="11" fill="#57606a">(the live check stopped it at step '
                     f'{pair.stopped_b}; verify --keep-going runs it on)</text>')
    for index, group in enumerate(lines):
        colour = _COLOURS[index % len(_COLOURS)]
        points = [(s, evidence[s][group].max_ulp) for s in sorted(evidence)
                  if group in evidence[s] and evidence[s][group].max_ulp is not None]
        path = " ".join(f"{x(s):.1f},{y(u):.1f}" for s, u in points)
        parts.append(f'<polyline class="ulp-line" fill="none" stroke="{colour}" stroke-width="2.2" points="{path}"/>')
        for s, u in points:
            parts.append(f'<circle cx="{x(s):.1f}" cy="{y(u):.1f}" r="3" fill="{colour}"><title>'
                         f'{_esc(group[0])}, step {s}: {u:,} ulp</title></circle>')
    for row, group in enumerate(bands):
        y0 = bottom_axis + 28 + row * band_h
        parts.append(f'<text x="{left - 6}" y="{y0 + 12}" text-anchor="end" font-size="12">{_esc(group[0])}</text>'
                     f'<rect x="{left}" y="{y0}" width="{width - left - right}" height="{band_h - 4}" fill="#f1f4f7"/>')
        cell_w = max((width - left - right) / span, 2)
        for s in sorted(evidence):
            cell = evidence[s].get(group)
            if cell is None or not (cell.differ or cell.missing):
                continue
            colour, what = ("#cf222e", f"{cell.differ} of {cell.records} record(s) differ (digests: no magnitude)") \
                if cell.differ else ("#d4a72c", f"{cell.missing} record(s) in one run only")
            parts.append(f'<rect class="band-diff" x="{x(s) - cell_w / 2:.1f}" y="{y0}" width="{cell_w:.1f}" '
                         f'height="{band_h - 4}" fill="{colour}"><title>{_esc(group[0])}, step {s}: {_esc(what)}'
                         "</title></rect>")
    every = max(1, math.ceil(span / 12))
    for s in range(low, high + 1):
        if (s - low) % every == 0 or s == high:
            parts.append(f'<text x="{x(s):.1f}" y="{bottom_axis + 16}" text-anchor="middle" font-size="12">{s}'
                         "</text>")
    parts.append(f'<text x="{left - 6}" y="{bottom_axis + 16}" text-anchor="end" font-size="12" '
                 'fill="#57606a">step</text>')
    if first_step is not None and low <= first_step <= high:
        fx = x(first_step)
        parts.append(f'<line class="first-divergence" x1="{fx:.1f}" x2="{fx:.1f}" y1="{top - 6}" y2="{height - 8}" '
                     f'stroke="#a40e26" stroke-width="2" stroke-dasharray="6,3"/>'
                     f'<text x="{fx + 5:.1f}" y="{top - 9}" font-size="12" font-weight="700" fill="#a40e26">'
                     f"first divergence: step {first_step}</text>")
    legend = "".join(f'<span style="background:{_COLOURS[i % len(_COLOURS)]}"></span>{_esc(g[0])}'
                     for i, g in enumerate(lines))
    if bands:
        legend += ('<span style="background:#cf222e"></span>tensor group differs (digests: ulps unknown)'
                   '<span style="background:#d4a72c"></span>in one run only')
    return (f'<svg class="ulp-plot" id="ulp-plot" data-scale="log" width="100%" viewBox="0 0 {width} {height}" '
            f'role="img"><title>ulp distance between a and b per step (log scale)</title>{"".join(parts)}</svg>'
            f'<p class="legend" id="ulp-legend">{legend or "no metric recorded on this rank"}</p>')


def _short_names(pair: Pair) -> tuple[str, str]:
    """What sentences call the two runs: verify's A, B, C, else a and b."""
    names = []
    for name, fallback in zip(pair.names, ("a", "b")):
        word = name.removeprefix("run ").split(" ")[0] if name.startswith("run ") else ""
        names.append(word if word in ("A", "B", "C") else fallback)
    return names[0], names[1]


def _state_chart(track: StateTrack, picture: StatePicture, pair: Pair, label_a: str, label_b: str) -> str:
    """One census record of b against a as an inline SVG: x the step, y the step of a whose
    state the run holds; a on the diagonal (solid), b dashed with a red mark where it is not on
    the diagonal, a cross in the top band where no step of a holds its state, the generators'
    draws as ticks under the axis, the steps the live check cut hatched."""
    width, left, right, top, band = 540, 74, 14, 40, 22
    plot_h = 150
    draws = 2 if track.is_generator else 0
    axis_y = top + band + plot_h
    height = axis_y + 22 + draws * 14 + 6
    start = min(picture.window) if picture.window else 0
    xs = sorted(set(picture.window) | {s for s in picture.steps_a if s >= start})
    low_x, high_x = xs[0], max(xs[-1], xs[0] + 1)
    ys = picture.steps_a or [0]
    low_y, high_y = min(ys), max(max(ys), min(ys) + 1)

    def x(step: float) -> float:
        return left + (step - low_x) / (high_x - low_x) * (width - left - right)

    def y(step: float) -> float:
        return top + band + (high_y - step) / (high_y - low_y) * plot_h

    parts = [f'<rect x="{left}" y="{top + band}" width="{width - left - right}" height="{plot_h}" fill="#fbfcfd" '
             'stroke="#d0d7de"/>',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{band - 4}" fill="#f6f8fa"/>'
             f'<text x="{left - 5}" y="{top + 13}" text-anchor="end" font-size="10" fill="#57606a">no step</text>']
    cut = [s for s in xs if pair.cut(s)]
    if cut:
        x0 = x(cut[0] - 0.5)
        parts.append(f'<rect class="cut" x="{x0:.1f}" y="{top}" width="{max(width - right - x0, 0):.1f}" '
                     f'height="{axis_y - top}" fill="#eef1f4"><title>{_esc(pair.names[1])}: not run past the first '
                     f'divergence (live check)</title></rect><text x="{(x0 + width - right) / 2:.0f}" '
                     f'y="{top + band + 14}" text-anchor="middle" font-size="11" fill="#57606a">'
                     + (f"{_esc(label_b)} not run past the first divergence" if width - right - x0 > 220 else
                        "not run") + "</text>")
    for k in _ticks(low_y, high_y):
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(k):.1f}" y2="{y(k):.1f}" stroke="#e5e9ee"/>'
                     f'<text x="{left - 5}" y="{y(k) + 4:.1f}" text-anchor="end" font-size="11">{k}</text>')
    for k in _ticks(low_x, high_x):
        parts.append(f'<text x="{x(k):.1f}" y="{axis_y + 14}" text-anchor="middle" font-size="11">{k}</text>')
    parts.append(f'<text x="{left - 5}" y="{axis_y + 14}" text-anchor="end" font-size="11" fill="#57606a">step'
                 f'</text><text x="16" y="{top + band + plot_h / 2:.0f}" font-size="11" text-anchor="middle" '
                 f'transform="rotate(-90 16 {top + band + plot_h / 2:.0f})">{_esc(label_a)}\'s step held</text>')
    diagonal = [s for s in picture.steps_a if low_x <= s <= high_x]
    if diagonal:
        parts.append(f'<polyline class="state-a" fill="none" stroke="{COLOUR_A}" stroke-width="2.4" points="'
                     + " ".join(f"{x(s):.1f},{y(s):.1f}" for s in diagonal) + '"/>')
    held = [(s, t) for s, t in sorted(track.positions.items()) if t is not None]
    if held:
        parts.append(f'<polyline class="state-b" fill="none" stroke="{COLOUR_B}" stroke-width="2.4" {_DASHED} '
                     'points="' + " ".join(f"{x(s):.1f},{y(t):.1f}" for s, t in held) + '"/>')
    for s, t in sorted(track.positions.items()):
        if t is None:
            tip = f"step {s}: {label_b}'s {track.title} matches no step of {label_a}"
            parts.append(f'<text class="state-none" x="{x(s):.1f}" y="{top + 14}" text-anchor="middle" '
                         f'font-size="15" font-weight="700" fill="#cf222e">&#215;<title>{_esc(tip)}</title></text>')
        elif t != s:
            tip = f"step {s}: {label_b} holds {label_a}'s {track.title} of step {t}"
            parts.append(f'<circle class="state-differs" cx="{x(s):.1f}" cy="{y(t):.1f}" r="4.5" fill="#cf222e">'
                         f"<title>{_esc(tip)}</title></circle>")
        else:
            tip = f"step {s}: {label_b}'s {track.title} is {label_a}'s of this step"
            parts.append(f'<circle class="state-same" cx="{x(s):.1f}" cy="{y(t):.1f}" r="3" fill="{COLOUR_B}">'
                         f"<title>{_esc(tip)}</title></circle>")
    for s, where in sorted(track.only_in.items()):
        tip = f"step {s}: only {label_a if where == 'a' else label_b} records its {track.title}"
        parts.append(f'<rect class="state-only" x="{x(s) - 4:.1f}" y="{top + 5}" width="8" height="8" fill="#d4a72c">'
                     f"<title>{_esc(tip)}</title></rect>")
    for row, (who, colour, steps) in enumerate(((label_a, COLOUR_A, track.drawn_a),
                                                (label_b, COLOUR_B, track.drawn_b))[:draws]):
        y0 = axis_y + 22 + row * 14
        parts.append(f'<text x="{left - 5}" y="{y0 + 8}" text-anchor="end" font-size="10" fill="#57606a">'
                     f"{_esc(who)} drew</text>")
        for s in steps:
            parts.append(f'<rect class="draw-{"a" if row == 0 else "b"}" x="{x(s) - 3:.1f}" y="{y0}" width="6" '
                         f'height="10" fill="{colour}"><title>{_esc(f"step {s}: {who} drew from the {track.title}")}'
                         "</title></rect>")
    legend = (f'<g font-size="12"><line x1="{left}" y1="14" x2="{left + 30}" y2="14" stroke="{COLOUR_A}" '
              f'stroke-width="2.4"/><text x="{left + 36}" y="18">{_esc(label_a)}: {_esc(pair.names[0])}</text>'
              f'<line x1="{left + 230}" y1="14" x2="{left + 260}" y2="14" stroke="{COLOUR_B}" stroke-width="2.4" '
              f'{_DASHED}/><text x="{left + 266}" y="18">{_esc(label_b)}: {_esc(pair.names[1])}</text></g>')
    svg = (f'<svg class="chart state-chart" data-record="{_esc(track.name)}" width="100%" '
           f'viewBox="0 0 {width} {height}" role="img"><title>{_esc(track.title)}: the step of {_esc(label_a)} '
           f"whose state each run holds</title>{legend}{''.join(parts)}</svg>")
    return (f'<div class="chart-box"><h3>{_esc(track.title)}<span class="note mono">{_esc(track.name)}</span></h3>'
            f'{svg}<p class="mono wrap small">{_esc(track.says(label_a, label_b))}</p></div>')


def _ticks(low: int, high: int) -> list[int]:
    """At most about 6 whole-step ticks from ``low`` to ``high``."""
    every = max(1, math.ceil((high - low) / 6))
    return list(range(low, high + 1, every))


def _chart(name: str, series_a: dict[int, Record], series_b: dict[int, Record], pair: Pair,
           first_step: int | None) -> str:
    """One metric of both runs as an inline SVG line chart: a solid, b dashed in another colour,
    the steps whose bits differ marked, the first divergence and the steps the live check cut."""
    title = _metric_title(name)
    width, height, left, right, top, bottom = 540, 230, 74, 14, 38, 30
    cut = [s for s in series_a if s not in series_b and pair.cut(s)]
    steps = sorted(set(series_a) | set(series_b))
    values = [v for s in steps for v in (float_value(series_a[s]) if s in series_a else None,
                                        float_value(series_b[s]) if s in series_b else None)
              if v is not None and math.isfinite(v)]
    equal = sum(1 for s in steps if s in series_a and s in series_b and series_a[s].raw == series_b[s].raw)
    both = sum(1 for s in steps if s in series_a and s in series_b)
    first_diff = next((s for s in steps if s in series_a and s in series_b and series_a[s].raw != series_b[s].raw), None)
    caption = f"{equal} of {both} common step(s) bit-identical"
    if first_diff is not None:
        ulp, relative = metric_distance(series_a[first_diff], series_b[first_diff])
        caption += (f"; first differing step {first_diff}: a = {series_a[first_diff].summary()}, "
                    f"b = {series_b[first_diff].summary()}" + (f", {ulp} ulp" if ulp is not None else "")
                    + (f", relative {relative:.3e}" if relative is not None else ""))
    recorded = f" (recorded as {name})" if title != name else ""
    head = f'<div class="chart-box"><h3>{_esc(title)}<span class="note mono">{_esc(recorded)}</span></h3>'
    if not steps or not values:
        return f"{head}<p class=\"mono wrap\">{_esc(caption)} (no finite values to draw)</p></div>"
    low, high = min(values), max(values)
    if high == low:
        low, high = low - 1.0 if low == 0 else low - abs(low) * 0.05, high + 1.0 if high == 0 else high + abs(high) * 0.05
    first, last = steps[0], steps[-1]
    span = max(last - first, 1)

    def x(step: float) -> float:
        return left + (step - first) / span * (width - left - right)

    def y(value: float) -> float:
        return top + (high - value) / (high - low) * (height - top - bottom)

    def line(series: dict[int, Record], extra: str, colour: str, css: str) -> str:
        points = [f"{x(s):.1f},{y(v):.1f}" for s in steps if s in series
                  for v in [float_value(series[s])] if v is not None and math.isfinite(v)]
        if not points:
            return ""
        return (f'<polyline class="{css}" fill="none" stroke="{colour}" stroke-width="2.4" {extra} '
                f'points="{" ".join(points)}"/>')

    parts = []
    start = pair.start_step or 0
    if start > first:
        parts.append(f'<rect x="{left}" y="{top}" width="{max(x(start) - left, 0):.1f}" '
                     f'height="{height - top - bottom}" fill="#eef1f4"><title>before the compared window</title>'
                     '</rect>')
    if cut:
        x0 = x(min(cut) - 0.5)
        parts.append(f'<rect class="cut" x="{x0:.1f}" y="{top}" width="{width - right - x0:.1f}" '
                     f'height="{height - top - bottom}" fill="#eef1f4"><title>{_esc(pair.names[1])}: not run past '
                     f'the first divergence (live check)</title></rect><text x="{(x0 + width - right) / 2:.0f}" '
                     f'y="{top + 14}" text-anchor="middle" font-size="11" fill="#57606a">'
                     + ("b not run past the first divergence" if width - right - x0 > 220 else "not run") + "</text>")
    for fraction in (0.0, 0.5, 1.0):
        value = low + (high - low) * fraction
        parts.append(f'<line x1="{left}" x2="{width - right}" y1="{y(value):.1f}" y2="{y(value):.1f}" '
                     'stroke="#e5e9ee"/>'
                     f'<text x="{left - 5}" y="{y(value) + 4:.1f}" text-anchor="end" font-size="11">'
                     f'{_esc(f"{value:.5g}")}</text>')
    parts.append(f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" '
                 'stroke="#8c959f"/>'
                 f'<text x="{left}" y="{height - 10}" font-size="11">step {first}</text>'
                 f'<text x="{width - right}" y="{height - 10}" text-anchor="end" font-size="11">step {last}</text>')
    if first_step is not None and first <= first_step <= last:
        parts.append(f'<line class="first-divergence" x1="{x(first_step):.1f}" x2="{x(first_step):.1f}" y1="{top}" '
                     f'y2="{height - bottom}" stroke="#a40e26" stroke-width="1.5" stroke-dasharray="5,3"/>'
                     f'<text x="{x(first_step) + 4:.1f}" y="{height - bottom - 4}" font-size="11" fill="#a40e26">'
                     f"first divergence</text>")
    parts.append(line(series_a, "", COLOUR_A, "curve-a") + line(series_b, _DASHED, COLOUR_B, "curve-b"))
    for s in steps:
        if s not in series_a or s not in series_b or series_a[s].raw == series_b[s].raw:
            continue
        value = float_value(series_b[s])
        if value is None or not math.isfinite(value):
            continue
        ulp, _ = metric_distance(series_a[s], series_b[s])
        tip = (f"step {s}: bits differ; a = {series_a[s].summary()}, b = {series_b[s].summary()}"
               + (f", {ulp} ulp" if ulp is not None else ""))
        parts.append(f'<circle class="mark-ne" cx="{x(s):.1f}" cy="{y(value):.1f}" r="2.6" fill="#cf222e">'
                     f"<title>{_esc(tip)}</title></circle>")
    legend = (f'<g class="chart-legend" font-size="12"><line x1="{left}" y1="14" x2="{left + 30}" y2="14" '
              f'stroke="{COLOUR_A}" stroke-width="2.4"/><text x="{left + 36}" y="18">a: {_esc(pair.names[0])}</text>'
              f'<line x1="{left + 230}" y1="14" x2="{left + 260}" y2="14" stroke="{COLOUR_B}" stroke-width="2.4" '
              f'{_DASHED}/><text x="{left + 266}" y="18">b: {_esc(pair.names[1])}</text></g>')
    svg = (f'<svg class="chart" width="100%" viewBox="0 0 {width} {height}" role="img">'
           f'<title>{_esc(title)}</title>{legend}{"".join(parts)}</svg>')
    return f"{head}{svg}<p class=\"mono wrap small\">{_esc(caption)}</p></div>"


__all__ = ["build_report", "write_report", "differing_records", "Report", "Pair"]
