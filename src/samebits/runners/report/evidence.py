"""What the page shows, re-derived rather than copied: verdicts held to their checks (a summary
or certificate whose verdict contradicts them is refused; a more cautious one stands, said in
the notes), and the runs compared again, their streams read once per rank for the drawings.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from samebits.autorecord import read_stop
from samebits.compare import DiffResult, diff, divergent_steps
from samebits.errors import ConfigError, IncomparableRunsError, StreamError
from samebits.runners.across import CONTROL_STEPS
from samebits.runners.conclusion import diff_conclusion, diff_window, window_words
from samebits.runners.distance import metric_distance
from samebits.runners.report.summaries import _verdict
from samebits.stream import Record, StreamHeader, open_run, phases
from samebits.verdicts import Verdict


MAX_READ_RANKS = 16384  # ranks whose steps are read for the heatmap (the rest are counted, not drawn)
# What a person calls the recorded metrics: zero-code recording records the root of backward()
# (the loss), the recipe records loss, grad_norm and lr under "metrics".
_METRIC_NAMES = {f"{phases.BACKWARD}/root": "loss", f"{phases.METRICS}/loss": "loss",
                 f"{phases.METRICS}/grad_norm": "grad norm", f"{phases.METRICS}/lr": "lr",
                 f"{phases.METRICS}/learning_rate": "lr"}
_METRIC_ORDER = ("loss", "grad norm", "lr")


def _check_verdict(check: dict, file: Path, where: str) -> Verdict:
    """A check's verdict word, held to the evidence the check carries: DIVERGED needs its first
    divergence; IDENTICAL allows none, nor anything incomplete, missing or compared by shape only."""
    verdict = _verdict(check.get("verdict"), file, f"the verdict of {where}")
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
    """verify's verdict from its checks (`samebits.runners.verify.VerifyResult.verdict`)."""
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
    (`samebits.runners.across.AcrossResult.verdict`), for a summary or a certificate alike."""
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


def _matrix_verdict(summary: dict, file: Path) -> tuple[Verdict, str]:
    """matrix's verdict from its cells and failures (`samebits.runners.matrix.MatrixResult.verdict`),
    each cell's verdict held to its checks (PASS: none diverged or undecided; FAIL: one diverged)."""
    cells = summary.get("cells") or []
    verdicts = []
    for index, cell in enumerate(cells):
        where = f"cell {index} ({cell.get('cell')} {cell.get('precision')})"
        verdict = _verdict(cell.get("verdict"), file, f"field 'cells[{index}].verdict'")
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
    headers: tuple[StreamHeader | None, StreamHeader | None] = (None, None)
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


def _pair_summary(pair: Pair) -> dict:
    """A compared pair in the report's JSON; each rank's first divergent step is in the same
    window as the first divergence, so the two agree."""
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
    say(f"      {pair.verdict.value} ({time.perf_counter() - began:.1f} s)")
    return pair


def _short_path(path: Path) -> str:
    """A run directory as a legend names it: its last two path components."""
    return "/".join(path.parts[-2:]) or str(path)


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
    if rank not in run.files:
        return found
    for block in run.steps(rank):
        if stop_after is not None and block.step > stop_after:
            break
        if steps is None or block.step in steps:
            found[block.step] = {r.key: r for r in block.records()}
    return found


def differing_records(a: str | Path, b: str | Path, *, rank: int, step: int) -> list[dict]:
    """Every record that differs between runs ``a`` and ``b`` at one rank and step (`diff` keeps
    only the first): both sides as recorded and how they differ (metrics: ulps from the exact
    bits; tensors: digests only), in ``a``'s record order, then records only in ``b``."""
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
        steps = _steps(run, run.ranks[0])
        firsts.append(steps[0] if steps else 0)
    return max(firsts) if firsts[0] != firsts[1] else None


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
    return name.replace("_", " ") if phase == phases.METRICS and name else label


def _metric_sort(title: str) -> tuple:
    return (_METRIC_ORDER.index(title) if title in _METRIC_ORDER else len(_METRIC_ORDER), title)


def _group_of(record: Record) -> tuple[str, str]:
    """A record's group and its kind: each metric is its own group, tensors group by phase."""
    if record.kind == "metric":
        return _metric_title(_key_label(record.key)), "metric"
    return phases.report_group(record.phase), "tensor"


def _group_sort(item: tuple[str, str]) -> tuple:
    name, kind = item
    if kind == "metric":
        return (0,) + _metric_sort(name)
    groups = phases.REPORT_GROUPS
    return (1, groups.index(name) if name in groups else len(groups), name)


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
    """One pass over both runs' streams of ``rank``: each step summarised (`_evidence_of`) and
    dropped, only its metrics kept, so memory stays that of the summaries."""
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
