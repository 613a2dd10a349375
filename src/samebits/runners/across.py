"""`samebits verify --across single,dp2,tp2`: the same training at several parallel layouts must
give the same bits, and the comparison must be able to tell layouts apart.

Every layout is compared with the first by global digest and rank 0's metrics (a run without
global records: by rank 0's replicated records, `compare_replicated`); with ``resume_across``
the others resume the first's checkpoint and must match it; negative controls (no switches)
must differ.  certificate.json holds what was proven.  docs/invariance.md ("Use it", "Resume at
another layout", "Certificate") tells the whole protocol.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import platform
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from samebits.checkpoint import content_sha256
from samebits.compare import DIFFERS, SHAPE_ONLY, DiffResult, Divergence, diff, record_match
from samebits.errors import ConfigError, SamebitsError
from samebits.runners._launch import RunFailed, run_logged, stopped_marked, UNFINISHED, write_stopped
from samebits.runners.commands import (CKPT, FROM, INVARIANT_VARIABLE, LAYOUT_VARIABLE, NPROC, OUT, RUN, STEP,
                                    RecipeRefused, cell_degrees, fill_placeholders, holds, prepare_out_dir,
                                    write_summary)
from samebits.runners.program import RECORD, RESUME, SAVE, Launch, Program, SelfRecording, ZeroCode, work_folder
from samebits.runners.verify import RunInfo
from samebits.stream import GLOBAL_PHASE_PREFIX, open_run, phases
from samebits.stream.reader import require_same_digest_version
from samebits.verdicts import ToDict, Verdict, milliseconds, serialised

ACROSS_PLACEHOLDERS = (NPROC, OUT)  # in a command for --across: the rank count, the run's folder
CERTIFICATE = "certificate.json"
CONTROL_STEPS = 2  # a control must differ at step 0 or 1: two steps show it
CONTROL_PREFIX = "control-"
RESUME_PREFIX = "resume-"
_SPEC = re.compile(r"^\s*dp\s*=\s*(\d+(?:\s*,\s*\d+)*)\s*$")


def parse_across(spec: str) -> list[int] | list[tuple[str, int]]:
    """A command's layouts: ``"dp=1,2,4"`` -> [1, 2, 4] (data-parallel sizes, ``{nproc}``), or cells
    ``"single,fsdp2,fsdp2-tp2"`` -> [(cell, ranks)] (a program that reads ``SAMEBITS_LAYOUT``,
    such as samebits' torchtitan config).  Distinct, at least two, in the order given."""
    match = _SPEC.match(spec or "")
    if not match:
        cells = [cell.strip() for cell in (spec or "").replace(" ", ",").split(",") if cell.strip()]
        parsed = [(cell, _cell_ranks(cell, spec)) for cell in cells]
        if len(parsed) < 2 or len(set(cells)) != len(cells):
            raise ConfigError(f"--across {spec!r}: give at least two distinct layouts")
        return parsed
    sizes = [int(n) for n in match.group(1).split(",")]
    if len(sizes) < 2 or len(set(sizes)) != len(sizes) or min(sizes) < 1:
        raise ConfigError(f"--across {spec!r}: give at least two distinct positive data-parallel sizes")
    return sizes


def _cell_ranks(cell: str, spec: str) -> int:
    """The ranks a command's cell takes: the product of its degrees."""
    try:
        return math.prod(cell_degrees(cell).values())
    except ConfigError:
        raise ConfigError(f"--across {spec!r} with a command: layout {cell!r} is neither dp=N,N,... (data-parallel "
                          "sizes) nor a cell: single, or fsdpN, dpN, tpN, ppN, cpN joined by - (e.g. fsdp2-tp2)") \
            from None


@dataclass(frozen=True)
class Layout:
    """One layout of ``verify --across``: ``control`` is the same layout without the switches
    (None: none); ``resume`` the command that resumes a checkpoint saved at another layout
    (``{ckpt}``) into ``{out}`` (None: the program's RESUME role)."""

    name: str
    nproc: int
    program: Program
    control: Program | None = None
    overrides: tuple[str, ...] = ()
    control_overrides: tuple[str, ...] = ()
    resume: tuple[str, ...] | None = None


# Declared name mappings: a wrapper that renames every parameter alike at one layout (DDP's
# ``module``); a record not found by its own name is looked for under these, said in the notes.
NAME_MAPPINGS = (("DDP's `module.` prefix", "module."), ("torch.compile's `_orig_mod.` prefix", "_orig_mod."))
_SHOWN = 6  # names listed in a note or a reason
# Phases whose records a rank holds by the layout (its micro-batches' inputs: dp2's rank 0 holds
# 0 and 1 of 4, dp4's only 0): one the other layout's rank does not hold is noted, never missing.
LAYOUT_LOCAL_PHASES = (phases.DATA,)


def compare_replicated(a, b, *, rank: int = 0, start_step: int | None = None, stop_step: int | None = None,
                       phases: Iterable[str] | None = None) -> DiffResult:
    """Compare rank ``rank``'s records of runs ``a`` and ``b`` (of any world sizes) step by step
    in [start, stop), matched by identity or a declared mapping (`NAME_MAPPINGS`).  Every
    record of ``a`` must be found in ``b`` with a digest: one missing, one without a digest or a
    step ``b`` lacks makes it INCOMPLETE naming them.  Records only ``b`` holds, and inputs
    ``b``'s rank does not hold at its layout (`LAYOUT_LOCAL_PHASES`), are listed in the notes."""
    start = 0 if start_step is None else start_step
    wanted = None if phases is None else set(phases)
    run_a, run_b = open_run(a), open_run(b)
    require_same_digest_version(run_a, run_b)  # digests of two versions never compare
    steps_a = _rank_steps(run_a, rank, start, stop_step, wanted)
    steps_b = _rank_steps(run_b, rank, start, stop_step, wanted)
    compared = {"ranks": 1, "steps": 0, "records": 0, "shape_only": 0, "missing": 0, "not_held": 0, "rank": rank,
                "world_size_a": run_a.world_size, "world_size_b": run_b.world_size}
    incomplete, only_b, not_held = [], set(), set()
    missing, shape_only, mapped = {}, {}, {}  # name -> first step; mapping label -> {a name: b name}
    first = None
    for step, records_a in steps_a.items():
        records_b = steps_b.get(step)
        if records_b is None:
            incomplete.append(f"step {step}: in {a} but not in {b} (rank {rank})")
            break
        compared["steps"] += 1
        matched, differing = set(), []
        for key, record in records_a.items():
            other_key = _find(key, records_b, mapped)
            if other_key is None:
                if key[1] in LAYOUT_LOCAL_PHASES:  # another layout's rank holds other micro-batches
                    compared["not_held"] += 1
                    not_held.add(f"{key[1]}/{key[2]}")
                    continue
                compared["missing"] += 1
                missing.setdefault(f"{key[1]}/{key[2]}", step)
                continue
            matched.add(other_key)
            other = records_b[other_key]
            match = record_match(record, other)
            if match == SHAPE_ONLY:
                compared["shape_only"] += 1
                shape_only.setdefault(f"{key[1]}/{key[2]}", step)
                continue
            compared["records"] += 1
            if match == DIFFERS:
                differing.append((key, record, other))
        only_b.update(f"{key[1]}/{key[2]}" for key in records_b if key not in matched)
        if differing:
            key, record, other = differing[0]
            first = Divergence(step=step, rank=rank, reason="content", phase=key[1], name=key[2],
                               occurrence=key[3], kind=key[0], a=record.to_dict(), b=other.to_dict(),
                               records_differing=len(differing),
                               detail=f"{key[1]}/{key[2]}: {record.summary()} vs {other.summary()}")
            break
    notes, incomplete = _what_was_not_compared(a, b, rank, incomplete, mapped, only_b, not_held, missing,
                                               shape_only)
    if first is not None:
        notes.extend(incomplete)  # the divergence is proof; what could not be compared is still said
        incomplete = []
    elif not incomplete and compared["records"] == 0:
        incomplete.append(f"nothing to compare: rank {rank} of {a} holds no record in the window "
                          f"[{start}, {stop_step if stop_step is not None else 'end'}) that {b} also holds")
    verdict = Verdict.DIVERGED if first is not None else Verdict.INCOMPLETE if incomplete else Verdict.IDENTICAL
    return DiffResult(a=str(a), b=str(b), verdict=verdict, first_divergence=first,
                      ranks_diverged_first=[rank] if first else [], divergences={rank: first} if first else {},
                      compared=compared, notes=notes, incomplete=incomplete)


def _what_was_not_compared(a, b, rank: int, incomplete: list[str], mapped: dict, only_b: set, not_held: set,
                           missing: dict, shape_only: dict) -> tuple[list[str], list[str]]:
    """`compare_replicated`'s notes and reasons it is incomplete, after ``incomplete``'s."""
    notes: list[str] = []
    for label, pairs in mapped.items():
        shown = ", ".join(f"{x} -> {y}" for x, y in sorted(pairs.items())[:_SHOWN])
        notes.append(f"matched by {label}: {len(pairs)} record name(s) of {a} found under another name in {b} "
                     f"({shown}{' ...' if len(pairs) > _SHOWN else ''})")
    if only_b:
        notes.append(f"only in {b} (not compared): {_names(only_b)}")
    if not_held:
        notes.append(f"only in {a}, inputs its rank {rank} holds at its layout and {b}'s does not (another "
                     f"share of the micro-batches; not compared): {_names(not_held)}")
    if missing:
        incomplete.append(f"{len(missing)} record(s) only in {a} (rank {rank}), not found in {b} by name or by a "
                          f"declared mapping ({', '.join(label for label, _ in NAME_MAPPINGS)}), so they were not "
                          f"compared: "
                          f"{_names(missing, steps=True)}")
    if shape_only:
        incomplete.append(f"{len(shape_only)} record(s) were compared by shape and dtype only, never by value: they "
                          f"hold no digest (over max_tensor_bytes when recorded): {_names(shape_only, steps=True)}. "
                          "To compare their values, record both runs without the cap or with a cap above the "
                          "largest tensor")
    return notes, incomplete


def _find(key: tuple, records_b: Mapping, mapped: dict) -> tuple | None:
    """``b``'s key for ``a``'s record ``key``: the same, else by a declared mapping (noted in ``mapped``)."""
    if key in records_b:
        return key
    kind, phase, name, occurrence = key
    for label, prefix in NAME_MAPPINGS:
        for other_name in (prefix + name, name[len(prefix):] if name.startswith(prefix) else None):
            if other_name is not None and (kind, phase, other_name, occurrence) in records_b:
                mapped.setdefault(label, {})[name] = other_name
                return (kind, phase, other_name, occurrence)
    return None


def _names(names, steps: bool = False) -> str:
    """A few of ``names`` (sorted), with the first step each was seen at when ``names`` maps them."""
    shown = sorted(names)[:_SHOWN]
    text = ", ".join(f"{n} (from step {names[n]})" if steps else n for n in shown)
    return text + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _rank_steps(run, rank: int, start: int, stop: int | None, phases: set | None) -> dict[int, dict]:
    """{step: {record key: record}} of one rank in [start, stop), phases filtered."""
    out = {}
    for block in run.steps(rank):
        if block.step < start or (stop is not None and block.step >= stop):
            continue
        out[block.step] = {r.key: r for r in block.records() if phases is None or r.phase in phases}
    return out


@dataclass
class LayoutCheck(ToDict):
    """One layout against the reference, ``by`` "global" (global digests and rank 0's ``metrics``)
    or by rank 0's replicated records (runs without global records)."""

    layout: str
    verdict: Verdict
    by: str
    first_divergence: dict | None
    compared: dict
    notes: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    metrics: dict | None = None  # rank 0's metrics compared (by "global")
    # what the verdict rests on: records compared by digest, by shape only, and missing (`_counts`)
    counts: dict = field(default_factory=lambda: {"compared": 0, "shape_only": 0, "missing": 0})

    def where(self) -> str:
        """Where it first differs (its first reason when INCOMPLETE), else "-"."""
        first = self.first_divergence or {}
        where = "-" if not first else f"step {first.get('step')}: {first.get('phase')}/{first.get('name')}"
        if Verdict(self.verdict) is Verdict.INCOMPLETE:
            where = "; ".join(self.incomplete[:1]) or where
        return where


@dataclass
class ControlCheck(ToDict):
    """A negative control: ``layout`` without the switches against the reference without them.
    ``differs`` (at ``first_step``, 0 or 1) is what it must do; ``verdict`` the comparison's."""

    layout: str
    run: str
    verdict: Verdict
    first_step: int | None
    detail: str = ""

    @property
    def differs(self) -> bool:
        return Verdict(self.verdict) is Verdict.DIVERGED and self.first_step is not None and \
            self.first_step < CONTROL_STEPS

    def dict_extras(self) -> dict:
        return {"differs": self.differs}


@dataclass
class AcrossResult(ToDict):
    """What ``verify --across`` found.  ``controls`` None: not run (``controls_note`` says why);
    ``resume`` None: not asked; ``checkpoints_equal`` None: not every final checkpoint hashed."""

    summary_of = "verify --across"  # its summary.json names the command that wrote it
    dict_keys = ("verdict", "out", "layouts", "reference", "checks", "controls", "controls_note", "resume_across",
                 "checkpoints", "checkpoints_equal", "runs", "notes", "timings_s")

    out: str
    layouts: list[str]
    # layout name (a size, when verify_across was given sizes) -> comparison with layouts[0]'s run
    checks: dict[str, LayoutCheck] = field(metadata=serialised(convert=lambda checks: _by_layout(checks)))
    runs: list[RunInfo] = field(default_factory=list)
    controls: list[ControlCheck] | None = None
    controls_note: str = ""
    # layout -> step -> global root (certificate.json has them)
    roots: dict[str, dict[int, str]] = field(default_factory=dict, metadata=serialised(skip=True))
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict, metadata=serialised(key="timings_s", convert=milliseconds))
    resume: dict[str, LayoutCheck] | None = field(default=None, metadata=serialised(  # written as resume_across
        skip=True, read=lambda data: None if not data.get("resume_across") else {
            name: LayoutCheck.from_dict(check) for name, check in data["resume_across"]["checks"].items()}))
    resume_at: int | None = field(default=None, metadata=serialised(
        skip=True, read=lambda data: (data.get("resume_across") or {}).get("step")))
    checkpoints: dict[str, dict] = field(default_factory=dict)  # layout -> its final checkpoint's hashes
    checkpoints_equal: bool | None = None

    @property
    def failed_controls(self) -> list[ControlCheck]:
        return [c for c in self.controls or [] if Verdict(c.verdict) is not Verdict.INCOMPLETE and not c.differs]

    @property
    def verdict(self) -> Verdict:
        verdicts = [Verdict(c.verdict) for c in [*self.checks.values(), *(self.resume or {}).values()]]
        if Verdict.DIVERGED in verdicts or self.failed_controls or self.checkpoints_equal is False:
            return Verdict.FAIL
        if not verdicts or any(v is not Verdict.IDENTICAL for v in verdicts) or \
                any(Verdict(c.verdict) is Verdict.INCOMPLETE for c in self.controls or []):
            return Verdict.INCOMPLETE
        return Verdict.PASS

    def dict_extras(self) -> dict:
        reference = self.layouts[0] if self.layouts else None
        resume = None if self.resume is None else {"step": self.resume_at, "from": reference,
                                                   "checks": _by_layout(self.resume)}
        return {"verdict": self.verdict, "reference": reference, "resume_across": resume}


def _by_layout(checks: Mapping) -> dict:
    """Checks as results write them: by each check's own layout name."""
    return {check.layout: check.to_dict() for check in checks.values()}


def command_layouts(spec: str | Sequence[int], cmd: Sequence[str], *, resume: Sequence[str] | None = None,
                    recording: Mapping[str, object] = {}) -> list[Layout]:
    """``verify --across`` of a command.  At data-parallel sizes (``dp=1,2``) the command records
    itself into ``{out}``, with no control and no resume.  At cells (``single,fsdp2``) it runs
    under zero-code recording with ``SAMEBITS_LAYOUT`` set to the cell (``{out}``: its work
    folder), its control is the same with ``SAMEBITS_INVARIANT=0``, and ``resume`` (``{from}``,
    ``{step}``, ``{out}``, ``{nproc}``) resumes the first layout's checkpoint."""
    missing = [p for p in ACROSS_PLACEHOLDERS if not holds(cmd, p)]
    if not cmd or missing:
        raise ConfigError(f"--across with a command: the command must contain {' and '.join(missing)} "
                          "({nproc}: the ranks of each run; {out}: its folder), "
                          "e.g. -- torchrun --nproc-per-node {nproc} train.py --out {out}")
    layouts = parse_across(spec) if isinstance(spec, str) else list(spec)
    if isinstance(layouts[0], int):
        if resume is not None:
            raise ConfigError("--resume-with with --across dp=N,...: a command that records itself has no resume "
                              "across; give cells (e.g. --across fsdp2,single) for a command that reads "
                              "SAMEBITS_LAYOUT, or drop --resume-with")
        return [Layout(f"dp{size}", size, SelfRecording(None, size, tuple(fill_placeholders(cmd, {NPROC: size}))))
                for size in layouts]
    result = []
    for cell, ranks in layouts:
        def program(invariant: bool) -> ZeroCode:
            return ZeroCode(tuple(fill_placeholders(cmd, {NPROC: ranks})),
                            None if resume is None else tuple(fill_placeholders(resume, {NPROC: ranks})),
                            recording=recording,
                            variables={LAYOUT_VARIABLE: cell, INVARIANT_VARIABLE: "1" if invariant else "0"})
        result.append(Layout(cell, ranks, program(True), control=program(False),
                             overrides=(f"{LAYOUT_VARIABLE}={cell}",),
                             control_overrides=(f"{LAYOUT_VARIABLE}={cell}", f"{INVARIANT_VARIABLE}=0")))
    return result


def verify_across(layouts: Sequence[Layout], out=None, *, rank: int = 0, controls: bool = True,
                  reductions: Sequence[dict] = (), run_timeout: float | None = None,
                  progress: Callable[[str], None] | None = None, resume_across: bool = False,
                  resume_at: int | None = None) -> AcrossResult:
    """Run the training at each layout (and the negative controls, when every layout has one),
    compare each with the first, and write summary.json and certificate.json into ``out``.

    A layout whose program saves also saves steps ``resume_at`` (default ``steps // 2``: for
    replay, and where ``resume_across`` resumes the others) and its final step (hashed for the
    certificate, as is a resume's final checkpoint).  ``reductions``: the certificate's list of
    what the switches make invariant.
    """
    if not layouts:
        raise ConfigError("verify --across: no layouts to run")
    resume_at = _resume_step(layouts, resume_across, resume_at)
    for layout in layouts:  # each layout's options and config, before any run and any folder
        try:
            layout.program.refuse_early()
        except RecipeRefused as err:
            raise ConfigError(f"--across: layout {layout.name}: {err}") from None
    out = prepare_out_dir(out, "across")
    say = progress or (lambda message: None)
    result = AcrossResult(out=str(out), layouts=[layout.name for layout in layouts], checks={})
    checkpoints = {}
    run = _Runner(out, result, run_timeout, progress, say)
    with stopped_marked(out, result.runs):  # a killed verify leaves summary.json saying so (issue 34)
        for layout in layouts:
            checkpoints[layout.name] = _run_layout(layout, run, resume_at)
        if resume_across:
            result.resume, result.resume_at = {}, resume_at
            first = checkpoints[layouts[0].name]  # None: a command, which saves where it saves itself
            saved = work_folder(out / layouts[0].name) if first is None else first["path"] / f"step-{resume_at}"
            for layout in layouts[1:]:
                result.resume[layout.name] = _resume_layout(layout, layouts[0].name, saved, resume_at, run)
                resumed_ckpt = out / (RESUME_PREFIX + layout.name) / "ckpt"
                if resumed_ckpt.is_dir():  # a resume that saved its final step: its state must be the same too
                    checkpoints[RESUME_PREFIX + layout.name] = {"steps": [layout.program.steps],
                                                                "final": layout.program.steps, "path": resumed_ckpt}
        run_controls = controls and all(layout.control is not None for layout in layouts)
        for layout in layouts if run_controls else ():
            name = CONTROL_PREFIX + layout.name
            run(name, layout.control.launch(RECORD, out / name), layout.control)
    reference = out / layouts[0].name
    for layout in layouts[1:]:
        say(f"comparing {layout.name} with {layouts[0].name}")
        result.checks[layout.name] = compare_layouts(reference, out / layout.name, layout.name, rank=rank)
    if run_controls:
        result.controls = [compare_control(out / (CONTROL_PREFIX + layouts[0].name), out / (CONTROL_PREFIX + l.name),
                                           l.name) for l in layouts[1:]]
    else:
        result.controls_note = ("not run: --no-controls" if not controls else
                                "not run: a command has no switch to turn off (controls need the recipe)"
                                if any(layout.program.steps is None for layout in layouts) else
                                "not run: a layout has no control program")
    result.roots = {layout.name: global_roots(out / layout.name) for layout in layouts}
    result.checkpoints, result.checkpoints_equal, note = final_checkpoints(checkpoints)
    if note:
        result.notes.append(note)
    write_summary(out, result)
    write_certificate(out, result, layouts, reductions)
    return result


def _resume_step(layouts: Sequence[Layout], resume_across: bool, resume_at: int | None) -> int | None:
    """Where the other layouts resume the first's checkpoint (None: they do not), refused when
    they cannot (a program with no resume) or it lies outside the run."""
    if not resume_across:
        if resume_at is not None:
            raise ConfigError("--resume-at with --across needs --resume-across (where the other layouts resume)")
        return None
    steps = layouts[0].program.steps
    if any(layout.resume is None and not layout.program.resumes for layout in layouts[1:]):
        raise ConfigError("--resume-across with a command: give --resume-with 'CMD' (how a layout resumes the "
                          "first one's checkpoint: {from} its work folder, {step}, {out}, {nproc}) and --resume-at K")
    if steps is None:
        if resume_at is None or resume_at < 1:
            raise ConfigError("--resume-across with a command: give --resume-at K (the step whose checkpoint the "
                              "first layout saves, as its own checkpointing names it)")
        return resume_at
    resume_at = steps // 2 if resume_at is None else resume_at
    if not 0 < resume_at < steps:
        raise ConfigError(f"--resume-at {resume_at}: the resume step must lie inside the run, between 1 and "
                          f"{steps - 1} (--steps {steps})")
    return resume_at


@dataclass
class _Runner:
    """Runs one of verify --across's runs into out/NAME, logged and judged by its program; a run
    that failed raises `RunFailed`."""

    out: Path
    result: AcrossResult
    run_timeout: float | None
    progress: Callable[[str], None] | None
    say: Callable[[str], None]

    def __call__(self, name: str, launch: Launch, program: Program, steps: int | None = None) -> None:
        self.say(f"running {name}: {shlex.join(launch.argv)}")
        log = self.out / "logs" / f"{name}.log"
        code, seconds = run_logged(launch.argv, log, env=launch.env, label=name,
                                   timeout=self.run_timeout or 1800.0, progress=self.progress,
                                   streams=launch.streams, steps=steps if steps is not None else program.steps)
        self.result.timings[name] = seconds
        self.result.runs.append(RunInfo(name, shlex.join(launch.argv), code, seconds))
        write_stopped(self.out, self.result.runs, UNFINISHED)  # what it had, should verify itself be killed next
        program.judge(name, launch, code, log)


def _run_layout(layout: Layout, run: _Runner, resume_at: int | None) -> dict | None:
    """Run one layout into out/NAME; its checkpoints ({"steps", "final", "path"}) or None."""
    program, run_dir = layout.program, run.out / layout.name
    if not program.template(SAVE) or program.steps is None:  # it saves nothing, or where it saves itself
        run_dir.mkdir(parents=True, exist_ok=True)
        run(layout.name, program.launch(RECORD, run_dir), program)
        return None
    middle = program.steps // 2 if resume_at is None else resume_at
    saves = sorted({step for step in (middle, program.steps) if step > 0})
    launch = program.launch(SAVE, run_dir, values={STEP: ",".join(map(str, saves)), CKPT: run_dir / "ckpt"})
    run(layout.name, launch, program)
    return {"steps": saves, "final": program.steps, "path": run_dir / "ckpt"}


def _resume_layout(layout: Layout, reference: str, saved: Path, step: int, run: _Runner) -> LayoutCheck:
    """``layout`` resumes ``reference``'s checkpoint of ``step`` into out/resume-NAME, compared with
    the reference from ``step`` on; a resume refused or failed is INCOMPLETE, with the reason."""
    name = RESUME_PREFIX + layout.name
    run_dir = run.out / name
    program = layout.program
    if program.steps is None:  # a command: its --resume-with, {from} the first layout's work folder
        run_dir.mkdir(parents=True, exist_ok=True)
        launch = program.launch(RESUME, run_dir, values={STEP: step, FROM: saved}, step_offset=step)
    else:
        launch = program.launch(RESUME, run_dir, values={CKPT: saved})
    if layout.resume is not None:  # its own resume template (at another layout: --allow-layout-change)
        launch = Launch(fill_placeholders(layout.resume, {OUT: run_dir, CKPT: saved, RUN: name}), launch.env, run_dir)
    try:
        run(name, launch, program, None if program.steps is None else program.steps - step)
    except RunFailed as err:
        return LayoutCheck(layout.name, Verdict.INCOMPLETE, "resume", None, {"steps": 0},
                           incomplete=[f"{layout.name} could not resume {reference}'s checkpoint of step {step}: "
                                       f"{err.reason} (log: {run.out / 'logs' / (name + '.log')})"])
    run.say(f"comparing {name} with {reference} from step {step}")
    return compare_layouts(run.out / reference, run_dir, layout.name, start_step=step)


def _has_global_records(path, held: set[str] | None = None) -> bool:
    """Whether rank 0 of the run at ``path`` records global tensors (`Recorder.global_tensors`);
    ``held``: its first step's phases, when read already."""
    return any(phase.startswith(GLOBAL_PHASE_PREFIX) for phase in (_first_step_phases(path) if held is None else held))


def _first_step_phases(path) -> set[str]:
    """The phases of rank 0's first recorded step at ``path``."""
    run = open_run(path)
    for block in run.steps(run.ranks[0]):
        return {r.phase for r in block.records()}
    return set()


def compare_layouts(reference, other, name: str, *, rank: int = 0, start_step: int | None = None) -> LayoutCheck:
    """``other`` against ``reference`` from ``start_step`` on: by global digest and rank ``rank``'s
    metrics when the reference holds global records, else by its replicated records."""
    held = _first_step_phases(reference)
    if not _has_global_records(reference, held):
        local = compare_replicated(reference, other, rank=rank, start_step=start_step)
        data = local.to_dict()
        return LayoutCheck(name, Verdict(local.verdict), f"rank {rank}'s replicated records",
                           data.get("first_divergence"), local.compared, list(local.notes), list(local.incomplete),
                           counts=_counts(local))
    by_global = diff(reference, other, by="global", start_step=start_step)
    data = by_global.to_dict()
    notes = [n for n in by_global.notes if not n.startswith(("world size:", "config "))]
    if phases.METRICS not in held:  # zero-code recording records no metrics: by global digest alone
        return LayoutCheck(name, Verdict(by_global.verdict), "global", data.get("first_divergence"),
                           dict(by_global.compared), notes, list(by_global.incomplete), counts=_counts(None, by_global))
    metrics = compare_replicated(reference, other, rank=rank, phases=[phases.METRICS], start_step=start_step)
    metric_data = metrics.to_dict()
    verdicts = (Verdict(by_global.verdict), Verdict(metrics.verdict))
    verdict = Verdict.DIVERGED if Verdict.DIVERGED in verdicts else \
        Verdict.IDENTICAL if verdicts == (Verdict.IDENTICAL, Verdict.IDENTICAL) else Verdict.INCOMPLETE
    first = data.get("first_divergence")
    if first is None or (metric_data.get("first_divergence") and
                         metric_data["first_divergence"]["step"] < first["step"]):
        first = metric_data.get("first_divergence") or first
    return LayoutCheck(name, verdict, "global", first, dict(by_global.compared), notes + list(metrics.notes),
                       list(by_global.incomplete) + [f"metrics: {line}" for line in metrics.incomplete],
                       metrics={"verdict": metric_data["verdict"], "compared": metrics.compared},
                       counts=_counts(metrics, by_global))


def _counts(replicated: DiffResult | None, by_global=None) -> dict:
    """The certificate's counts: records compared by digest, by shape only, and missing; a global
    tensor counts once over the steps, a replicated record once per step."""
    done = {} if replicated is None else replicated.compared
    counts = {"compared": done.get("records", 0), "shape_only": done.get("shape_only", 0),
              "missing": done.get("missing", 0)}
    for tensor in [] if by_global is None else by_global.tensors:
        if tensor.status != "only_in_b":  # held by the other layout only: nothing of the first's left out
            counts[{"shape_only": "shape_only", "only_in_a": "missing"}.get(tensor.status, "compared")] += 1
    return counts


def compare_control(reference_control, control, name: str) -> ControlCheck:
    """A control against the reference's control: it must differ at step 0 or 1."""
    by_global = _has_global_records(reference_control)
    result = diff(reference_control, control, by="global") if by_global else \
        compare_replicated(reference_control, control)
    data = result.to_dict()
    first = data.get("first_divergence") or {}
    detail = (f"first differs at step {first.get('step')}: {first.get('phase')}/{first.get('name')}" if first else
              "; ".join(list(result.incomplete)[:1]) or "identical: the comparison cannot tell layouts apart")
    return ControlCheck(name, CONTROL_PREFIX + name, Verdict(result.verdict), first.get("step"), detail)


def global_roots(path) -> dict[int, str]:
    """Each step's global root: the SHA-256 (16 hex digits) of its global records over all ranks,
    sorted; ``"ranks disagree"`` where two ranks recorded one tensor differently."""
    entries: dict[int, dict] = {}
    disagree: set[int] = set()
    run = open_run(path)
    for rank in run.ranks:
        for block in run.steps(rank):
            step = entries.setdefault(block.step, {})
            for r in block.records():
                if r.kind != "tensor" or not r.phase.startswith(GLOBAL_PHASE_PREFIX):
                    continue
                key = (r.phase, r.name, r.occurrence)
                value = (r.dtype, list(r.shape or ()), None if r.digest is None else f"{r.digest:016x}")
                if step.setdefault(key, value) != value:
                    disagree.add(block.step)
    roots = {}
    for step, records in sorted(entries.items()):
        if not records:
            continue
        text = json.dumps(sorted([list(key), list(value)] for key, value in records.items()))
        roots[step] = "ranks disagree" if step in disagree else hashlib.sha256(text.encode()).hexdigest()[:16]
    return roots


def checkpoint_sha256(path: Path) -> dict:
    """The SHA-256 of a checkpoint's files (relative paths and content hashes, sorted), and their count."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    total = hashlib.sha256()
    for file in files:
        total.update(str(file.relative_to(path)).encode() + b"\0")
        total.update(hashlib.sha256(file.read_bytes()).digest())
    return {"sha256": total.hexdigest(), "files": len(files)}


def final_checkpoints(checkpoints: Mapping[str, dict | None]) -> tuple[dict, bool | None, str]:
    """Each layout's final checkpoint hashed by content, by resumable state (`content_sha256`: alike
    at any layout) and by files; whether every content and state hash is equal (None: not every
    one could be hashed); and a note saying which differ, where, or why one was not hashed."""
    hashes, problems = {}, []
    for name, saved in checkpoints.items():
        if saved is None:
            continue
        path = Path(saved["path"]) / f"step-{saved['final']}"
        if not path.is_dir():
            problems.append(f"{name} saved no checkpoint of its final step {saved['final']} ({path})")
            continue
        entry = {"step": saved["final"], "path": str(path)}
        try:
            hashed = content_sha256(path)
            entry.update(content_sha256=hashed["sha256"], state_sha256=hashed["state_sha256"],
                         state_parts=hashed["state_parts"])
        except SamebitsError as err:
            entry.update(content_sha256=None, state_sha256=None, content_error=str(err))
            problems.append(f"{name}'s checkpoint has no layout-independent hash: {err}")
        files = checkpoint_sha256(path)
        hashes[name] = {**entry, "files_sha256": files["sha256"], "files": files["files"]}
    if not hashes:
        return hashes, None, ""
    if problems:
        return hashes, None, "final checkpoints not compared: " + "; ".join(problems)
    first = next(iter(hashes))
    differ = [name for name, entry in hashes.items() if entry["content_sha256"] != hashes[first]["content_sha256"]]
    if differ:
        return hashes, False, (f"the final checkpoints' content hashes differ: {', '.join(differ)} against {first} "
                               "(the saved training state, model and optimizer tensors and progress, is not the same)")
    reference = hashes[first]
    states = {name: sorted(part for part, value in entry["state_parts"].items()
                           if value != reference["state_parts"].get(part))
              for name, entry in hashes.items() if entry["state_sha256"] != reference["state_sha256"]}
    if not states:
        return hashes, True, ""
    return hashes, False, ("the final checkpoints' resumable states differ although their contents are equal: "
                           + "; ".join(f"{name} in {', '.join(parts) or 'its state hash'}"
                                       for name, parts in states.items())
                           + f" against {first} (a resume of one would not continue like a resume of the other)")


def environment(reference) -> dict:
    """Where the certificate was made: versions, host, CPU, and the reference run's device."""
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    except OSError:
        pass
    config = open_run(reference).header.config
    return {"samebits": version("samebits"), "torch": version("torch"), "python": platform.python_version(),
            "platform": platform.platform(), "host": platform.node(), "cpu": cpu,
            "device": config.get("device") if isinstance(config, dict) else None}


def certificate(result: AcrossResult, layouts: Sequence[Layout], reductions: Sequence[dict] = ()) -> dict:
    """What ``verify --across`` proved, as the dictionary certificate.json holds."""
    commands = {run.name: run.command for run in result.runs}
    roots = result.roots
    steps = sorted({step for per_step in roots.values() for step in per_step})
    equal = bool(steps) and all(len({roots[name].get(step) for name in roots}) == 1 for step in steps)
    return {
        "kind": "samebits verify --across certificate",
        "verdict": result.verdict.value,
        "environment": environment(Path(result.out) / layouts[0].name),
        "reference": layouts[0].name,
        "layouts": [{"cell": layout.name, "world_size": layout.nproc, "overrides": list(layout.overrides),
                     "command": commands.get(layout.name)} for layout in layouts],
        "steps": steps,
        "roots": {name: {str(step): root for step, root in per_step.items()} for name, per_step in roots.items()},
        "roots_equal": equal,
        "checkpoints": result.checkpoints,
        "checkpoints_equal": result.checkpoints_equal,
        "checkpoints_note": ("each layout's checkpoint of the final step. content_sha256: the training state it "
                             "holds (every model and optimizer tensor's global value, its pieces joined by their "
                             "places, with the step and consumed samples), the same at any layout. state_sha256: "
                             "the whole resumable state, the content with every progress field, each parameter's "
                             "optimizer settings, the LR scheduler, the metadata less the layout's own entries and "
                             "rank 0's random states (state_parts: each part's hash); other ranks' random states "
                             "are left out (per rank by nature). Both must be equal. files_sha256: its files, whose "
                             "layout (ranks, shards) depends on the world size: they identify each layout's "
                             "artefact"),
        "resume_across": None if result.resume is None else {
            "step": result.resume_at, "from": layouts[0].name,
            "checks": {c.layout: _certified(c, command=commands.get(RESUME_PREFIX + c.layout))
                       for c in result.resume.values()}},
        "invariant_reductions": [dict(r) for r in reductions],
        "controls": None if result.controls is None else [
            {**c.to_dict(), "overrides": next((list(l.control_overrides) for l in layouts if l.name == c.layout), []),
             "command": commands.get(c.run)} for c in result.controls],
        "controls_note": result.controls_note,
        "checks": {c.layout: _certified(c, notes=list(c.notes)) for c in result.checks.values()},
    }


def _certified(check: LayoutCheck, **extra) -> dict:
    """A layout check as the certificate holds it, ``extra`` before its reasons."""
    return {"verdict": Verdict(check.verdict).value, "by": check.by, "steps": check.compared.get("steps"),
            "counts": dict(check.counts), "first_divergence": check.first_divergence, **extra,
            "incomplete": list(check.incomplete)}


def write_certificate(out: Path, result: AcrossResult, layouts: Sequence[Layout], reductions: Sequence[dict] = ()) -> Path:
    path = Path(out) / CERTIFICATE
    path.write_text(json.dumps(certificate(result, layouts, reductions), indent=2, default=str) + "\n")
    return path


__all__ = ["verify_across", "AcrossResult", "Layout", "LayoutCheck", "ControlCheck", "compare_replicated",
           "compare_layouts", "compare_control", "global_roots", "checkpoint_sha256", "final_checkpoints",
           "certificate", "write_certificate", "parse_across", "command_layouts", "ACROSS_PLACEHOLDERS", "CERTIFICATE", "CONTROL_STEPS",
           "RESUME_PREFIX"]
