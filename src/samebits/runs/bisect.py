"""`bisect`: narrow a divergence between two runs to its origin, one rung at a time.

Stages (each runs side A and side B, in this order, and stops as soon as it can):

1. ``steps``    rung 1 (phases, collectives, gradients, optimizer state, the model's inputs,
   the state census at each step start) for the whole run: the first divergent step and
   phase.  Identical runs stop here.  With two different commands, each is first run twice
   to separate run-to-run noise from the intended change; a side that is not repeatable is
   bisected against itself.
2. ``modules``  rung 2 for that step, stopping after it: the first divergent module.
3. ``ops``      rung 3 inside that module's subtree (its parent's for a backward finding,
   since a module's input gradient is the total of its consumers'), with call sites.
4. ``dump``     the same run with the origin's inputs and outputs saved, compared element
   by element (how many differ, where, by how many ulps, and whether the two outputs hold
   the same values in another order).

Stages 2 and 3 re-run a step: when the re-run diverges *earlier* than the traced step (a
nondeterminism that fires at a random step), they trace again from the earliest divergent
step seen; when it does not diverge at all, they try again, a bounded number of times.

The conclusion is proof or "not localised": a model input that already differs is the data
pipeline; an RNG op whose inputs matched, with a generator whose state differed at the step
start, is that generator; the same values in another order (an op's list argument, its two
outputs, or whole records such as the optimizer's parameters) are an ordering problem, named;
"below the dispatcher" needs a module whose inputs matched and whose output differs with no
ATen op inside it to blame.  Anything else is reported as not localised, with what was ruled
out.  A conclusion never contradicts an earlier stage: once a stage found "phase P: inputs
matched, output differs", the final kind is about P, about the state the step started from,
or not localised (`_Bisector._reconcile`).

A resume bisect (side B resumes A's checkpoint at step K) compares step K aligned on its
phases: the work before the step's first forward/backward/optimizer step (training phase
``pre``: A's leftovers of step K-1, B's start-up) is not compared there.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from samebits import settings
from samebits.autorecord import environment_for, recording_variables, with_variables
from samebits.checkpoint import describe_state_record
from samebits.errors import ConfigError, SamebitsError
from samebits.runs._explain import census_names, census_suspects
from samebits.runs._launch import failed, run_logged, teardown_note
from samebits.runs.commands import (CKPT, FROM, OUT, RUN, STEP, SelfRecording, check_out_dir, default_out_dir,
                                    fill_placeholders, holds, write_summary)
from samebits.stream.reader import open_run
from samebits.trace import (ENV_VARS, LEVEL_NAMES, EventSpec, OriginFinding, OriginReport, TraceConfig,
                            compare_elements, describe_record, dump_filename, find_origins, find_replica_mismatch,
                            parent_scope, same_values)
from samebits.verdicts import ToDict, Verdict, serialised

_TORCH_GENERATORS = ("rng.torch_cpu", "rng.cuda", "rng.user.")
STEPS_ATTEMPTS = 2  # pairs of runs of one command before it is called identical
MAX_RERUNS = 3  # pairs of runs a narrowing stage may take to see its divergence again

# ATen ops that draw from a generator: an origin among them is a generator's state.
RNG_OPS = frozenset({
    "aten::bernoulli", "aten::bernoulli_", "aten::native_dropout", "aten::dropout", "aten::feature_dropout",
    "aten::alpha_dropout", "aten::rand", "aten::rand_like", "aten::randn", "aten::randn_like", "aten::randint",
    "aten::randint_like", "aten::randperm", "aten::normal", "aten::normal_", "aten::uniform_", "aten::random_",
    "aten::exponential_", "aten::cauchy_", "aten::log_normal_", "aten::geometric_", "aten::multinomial",
    "aten::poisson", "aten::rrelu_with_noise", "aten::_fused_dropout", "aten::_standard_gamma",
})


@dataclass
class Command:
    """How to run one side: a command under zero-code recording, or a program that records
    itself (the reference recipe).  ``argv`` is a template: a program that records itself
    gets ``{out}`` (its stream folder) filled; a zero-code command gets ``{out}`` (its own work
    folder, new and empty for every run, so a trainer that resumes from the latest checkpoint in
    its output folder starts clean) and ``{run}`` (the run's label), as `samebits verify` fills
    them, and a resumed command (``step_offset`` K) ``{step}`` (K) and ``{from}`` (the work
    folder of the run it resumes: the bisect's first run of A)."""

    label: str
    argv: list[str]
    recipe: bool = False  # a program that records itself into {out} (and traces itself)
    exit_notes: list[str] = field(default_factory=list)
    step_offset: int | None = None  # a resumed command: its first step number (SAMEBITS_STEP_OFFSET)
    from_step: int | None = None  # record only steps >= this (SAMEBITS_STEPS=K:)
    spec: settings.RecordingSpec | None = None  # what to record (default: the environment's SAMEBITS_* choice)

    def launch(self, out_dir: Path, config: TraceConfig, log: Path, timeout: float | None = None,
               progress: Callable[[str], None] | None = None, work: Path | None = None,
               resumes: Path | None = None) -> float:
        """Run once, recording into ``out_dir``.  ``work``: the run's own work folder, the
        ``{out}`` of a zero-code command (default: OUT_DIR-work beside the streams); ``resumes``:
        the work folder of the run it resumes, its ``{from}``."""
        env = dict(os.environ)
        if self.recipe:  # it records itself; a resume bisect records only steps >= K on both sides
            argv = fill_placeholders(self.argv, {OUT: out_dir})
            if self.from_step is not None:
                env = with_variables(env, recording_variables(steps=f"{self.from_step}:"))
        else:
            work = work if work is not None else out_dir.with_name(out_dir.name + "-work")
            if holds(self.argv, OUT):
                work.mkdir(parents=True, exist_ok=True)
            values: dict[str, object] = {OUT: work, RUN: out_dir.name}
            if self.step_offset is not None:
                values[STEP] = self.step_offset
            if resumes is not None:
                values[FROM] = resumes
            argv = fill_placeholders(self.argv, values)
            # What to record (--exclude, SAMEBITS_EXCLUDE, ...) is the same for every run; only
            # the steps are the bisect's (a resume compares steps >= K).
            spec = self.spec if self.spec is not None else settings.RecordingSpec.from_env()
            env = environment_for(out_dir, command=shlex.join(self.argv), step_offset=self.step_offset,
                                  spec=spec, steps=None if self.from_step is None else f"{self.from_step}:")
        for name in ENV_VARS:
            env.pop(name, None)
        env.update(config.to_env())
        header = " ".join(f"{k}={v}" for k, v in sorted(config.to_env().items()))
        code, seconds = run_logged(argv, log, env=env, header=header, timeout=timeout, label=self.label,
                                   progress=progress, streams=out_dir)
        if not any(out_dir.glob("rank-*.sbs")):
            if code != 0:
                raise failed(self.label, argv, code, log)
            raise SamebitsError(f"run {self.label} recorded nothing into {out_dir}: is `{shlex.join(argv)}` "
                                "a PyTorch training script that calls optimizer.step()?")
        if code != 0:
            # A Python exception is a crash, whatever the streams say: zero-code recording
            # closes them at exit, so a run that died mid-training looks complete.
            crashed = "Traceback (most recent call last)" in log.read_text(errors="replace")
            note = None if crashed else teardown_note(self.label, code, out_dir, log)
            if note is None:
                raise failed(self.label, argv, code, log)
            self.exit_notes.append(note)
        return seconds


@dataclass
class Stage(ToDict):
    name: str
    rung: str
    scope: str  # what the stage traced, in words
    runs: dict[str, float] = field(default_factory=dict, metadata=serialised(  # label -> seconds
        key="runs_s", convert=lambda runs: {label: round(seconds, 2) for label, seconds in runs.items()}))
    verdict: str = ""
    finding: OriginFinding | None = None
    summary: str = ""


class DifferingElement(NamedTuple):
    index: list[int]
    a: Any
    b: Any
    ulp: int


@dataclass
class Elements(ToDict):
    """How the origin's two dumped outputs differ element by element: `compare_elements`'s
    result (``detail``, whose entries its dict holds first) for output ``output`` of the dumps
    ``pair`` (files ``dumps``)."""

    detail: dict = field(metadata=serialised(flatten=True))
    output: str
    pair: list[str]
    dumps: list[str]
    same_values: bool  # one output is a permutation of the other
    inputs_identical: bool  # every input matched in value and position
    inputs_differ: list[str] = field(default_factory=list)  # the input labels whose values differ
    inputs_permuted: bool = False  # the inputs hold the same tensors, in other positions

    @property
    def differing(self) -> int | None:
        return self.detail["differing"]

    @property
    def total(self) -> int:
        return self.detail["total"]

    @property
    def max_ulp(self) -> int | None:
        return self.detail["max_ulp"]

    @property
    def values(self) -> list["DifferingElement"]:
        """The first differing elements: index, both values, distance in ulps."""
        return [DifferingElement(v["index"], v["a"], v["b"], v["ulp"]) for v in self.detail["values"]]

    @property
    def dtype(self) -> str:
        return self.detail["dtype"]

    @property
    def shape(self) -> list[int]:
        return self.detail["shape"]


@dataclass(kw_only=True)
class Origin(OriginFinding):
    """What the bisection concludes: the finding it rests on (an `OriginFinding`: where, which
    event, why), plus ``kind`` (op, probe, collective, order, generator, input_batch, replicas,
    initial_state, resume_state, control_flow, below_dispatcher, not_localised), the sentence
    for a person and the origin's ``elements``.  Its ``state_differs`` are the census records
    the conclusion blames; ``state_differs_all`` every one that differs at the step start."""

    # Bisect's public JSON: the conclusion, then the finding's where, what and why.
    dict_keys = ("kind", "conclusion", "step", "rank", "phase", "module", "op", "id", "category", "classification",
                 "call_site", "elements", "catalog", "detail", "state_differs", "state_differs_all", "params",
                 "ranks")

    kind: str
    conclusion: str
    elements: Elements | None = None
    state_differs_all: list[str] = field(default_factory=list)
    params: list[str] | None = field(default=None, metadata=serialised(omit_none=True))  # replicas: those that differ
    ranks: list[int] | None = field(default=None, metadata=serialised(omit_none=True))  # replicas: the ranks involved

    @classmethod
    def of(cls, finding: OriginFinding, elements: Elements | None, kind: str, conclusion: str,
           state_differs: list[str] | None = None) -> "Origin":
        """The `Origin` that ``finding`` proves: ``kind`` (what the conclusion is about),
        ``conclusion`` (one sentence for a person), ``state_differs`` (the census records the
        conclusion blames; default: all that differ at the step start)."""
        found = {item.name: getattr(finding, item.name) for item in fields(OriginFinding)}
        found["state_differs"] = list(finding.state_differs if state_differs is None else state_differs)
        return cls(**found, kind=kind, conclusion=conclusion, elements=elements,
                   state_differs_all=list(finding.state_differs) + list(finding.state_unused))

    def dict_extras(self) -> dict:
        return {"id": self.event_id}


@dataclass
class ControlFlow(ToDict):
    """Where the two runs' recorded event sequences part."""

    step: int
    rank: int
    detail: str


@dataclass
class BisectResult(ToDict):
    dict_keys = ("verdict", "conclusion", "origin", "stages", "compared", "repeatable", "control_flow", "out", "notes",
                 "seconds")

    verdict: Verdict  # IDENTICAL or DIVERGED (a run that could not be compared raises instead)
    origin: Origin | None
    stages: list[Stage]
    out: str
    compared: str  # e.g. "a vs b", "a vs a (a is not repeatable)"
    repeatable: dict[str, bool] | None = None
    control_flow: ControlFlow | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = field(default=0.0, metadata=serialised(convert=lambda seconds: round(seconds, 1)))
    conclusion: str = ""  # one sentence: what differs and where the origin is (or why it is not known)


@dataclass
class _Evidence:
    """What the narrowing stages established, for the conclusion."""

    module_origin: OriginFinding | None = None  # a module whose inputs matched and whose output differs
    subtree: str | None = None  # where rung 3 looked
    ops_finding: OriginFinding | None = None  # rung 3's first difference (when it was not an op origin)
    reproduced: bool = True


class _Bisector:
    def __init__(self, side_a: Command, side_b: Command, out: Path, progress, stop_after: int | None,
                 same_command: bool, run_timeout: float | None = None):
        self.run_timeout = run_timeout
        self.side_a, self.side_b = side_a, side_b
        self.out = out
        self.say = progress or (lambda message: None)
        self.progress = progress  # also follows each run's steps live (`samebits.runs.progress`)
        self.stop_after = stop_after
        self.same_command = same_command
        self.stages: list[Stage] = []
        self.notes: list[str] = []
        #: (rank, step) -> every census record name of side a there (None: no census), so that a
        #: conclusion names only components the program has
        self.census_present: dict[tuple[int, int], set[str] | None] = {}
        self._sides: dict[str, Command] = {"a": side_a, "b": side_b}
        self.first_a_work: Path | None = None  # the first run of A's work folder: {from} of every resumed B
        self.from_step = side_b.from_step  # a resume bisect: only steps >= this are compared and traced
        self.resume_step = self.from_step  # b resumed a here (None when one side is bisected against itself)
        if self.from_step is not None:
            self.notes.append(f"b resumes at step {self.from_step} (its steps are numbered from there): only "
                              f"steps >= {self.from_step} are compared and traced")
        perturb = settings.read("SAMEBITS_TEST_PERTURB")
        self.perturb_b = EventSpec.parse(perturb, "SAMEBITS_TEST_PERTURB") if perturb else None
        if self.perturb_b is not None:
            self.notes.append(f"test hook: SAMEBITS_TEST_PERTURB={perturb} applied to side b's runs only")

    # -- running ----------------------------------------------------------------------------

    def run_stage(self, stage: Stage, config: TraceConfig, sides: list[tuple[str, Command]]) -> dict[str, Path]:
        number = len(self.stages) + 1
        self.stages.append(stage)
        self.say(f"[{number}] {stage.name:<8} rung {stage.rung:<8} {stage.scope}")
        dirs = {}
        for label, command in sides:
            directory = self.out / f"{number}-{stage.name}" / label
            self.say(f"      run {label} ...")
            run_config = config
            if self.perturb_b is not None and command.label.startswith("b"):
                run_config = config.with_(perturb=self.perturb_b)  # test hook: side B only
            work = self.out / "work" / f"{number}-{stage.name}" / label  # every run its own, new and empty
            resumes = self.first_a_work if command.step_offset is not None else None
            seconds = command.launch(directory, run_config,
                                     self.out / "logs" / f"{number}-{stage.name}-{label}.log", self.run_timeout,
                                     progress=self.progress, work=work, resumes=resumes)
            if self.first_a_work is None and label == "a" and not command.recipe:
                self.first_a_work = work  # every resumed B resumes this run's checkpoints ({from})
            self.notes.extend(command.exit_notes)
            command.exit_notes.clear()
            stage.runs[label] = seconds
            self.say(f"      run {label}: {seconds:.1f} s")
            dirs[label] = directory
        return dirs

    def conclude(self, stage: Stage, report: OriginReport) -> OriginFinding | None:
        stage.verdict = str(report.verdict)
        finding = report.first
        stage.finding = finding
        if finding is None:
            stage.summary = "identical"
        else:
            stage.summary = f"{finding.classification}: {finding.where()}"
            if finding.classification in ("control_flow", "order"):
                stage.summary += f" ({finding.detail})"
        self.say(f"      -> {stage.summary}")
        return finding

    def compare(self, a: Path, b: Path) -> OriginReport:
        """`find_origins` of a pair of runs; in a resume bisect, aligned on the resume step's
        phases (its "pre" work is no divergence), with a note when that dropped anything."""
        report = find_origins(a, b, resume_step=self.resume_step)
        for finding in report.findings.values():
            # the runs' own census (the generators the program made, by creation site; loader
            # positions; the recipe's state) joins the tracer's; a generator nobody drew from in
            # the step is no suspect
            finding.state_differs, finding.state_unused = census_suspects(
                finding.state_differs, a, b, finding.rank, finding.step)
            if (finding.rank, finding.step) not in self.census_present:  # what the program has (an LR scheduler?)
                self.census_present[(finding.rank, finding.step)] = census_names(a, finding.rank, finding.step)
        for note in report.notes:
            if note not in self.notes and self.resume_step is not None and "phase pre" in note:
                self.notes.append(note)
        return report

    def base_config(self, **changes) -> TraceConfig:
        config = TraceConfig(level=1, stop_after=self.stop_after).with_(**changes)
        if self.from_step and config.step_start < self.from_step:
            # A resume at step K: trace from K on both sides, so that each records the
            # parameters it starts step K with (the tracer records them at its first traced step).
            config = config.with_(step_start=self.from_step)
        return config

    def sides(self) -> list[tuple[str, Command]]:
        return [("a", self._sides["a"]), ("b", self._sides["b"])]

    # -- the stages ---------------------------------------------------------------------------

    def bisect(self) -> BisectResult:
        start = time.perf_counter()
        compared, repeatable = "a vs b", None
        a, b = self.side_a, self.side_b
        if self.same_command:
            # One command against itself: a race may not fire in one pair of runs, so an
            # identical pair is tried once more before the verdict.
            for attempt in range(STEPS_ATTEMPTS):
                stage = Stage("steps", "phases", "all steps, every rank"
                              + (f" (pair {attempt + 1} of {STEPS_ATTEMPTS})" if attempt else ""))
                dirs = self.run_stage(stage, self.base_config(), [("a", a), ("b", b)])
                _check_compared(dirs)
                report = self.compare(dirs["a"], dirs["b"])
                if not report.identical:
                    break
                if attempt + 1 < STEPS_ATTEMPTS:
                    self.conclude(stage, report)
        else:
            stage = Stage("steps", "phases", "all steps, every rank; each side twice (repeatability)")
            a2 = Command("a2", a.argv, a.recipe, step_offset=a.step_offset, from_step=a.from_step, spec=a.spec)
            b2 = Command("b2", b.argv, b.recipe, step_offset=b.step_offset, from_step=b.from_step, spec=b.spec)
            dirs = self.run_stage(stage, self.base_config(), [("a", a), ("a2", a2), ("b", b), ("b2", b2)])
            _check_compared(dirs)
            noise_a = find_origins(dirs["a"], dirs["a2"])
            noise_b = find_origins(dirs["b"], dirs["b2"])
            repeatable = {"a": noise_a.identical, "b": noise_b.identical}
            self.say("      repeatable: " + ", ".join(f"{side} {'yes' if ok else 'NO'}" for side, ok in repeatable.items()))
            if not noise_a.identical:
                compared, report, b = "a vs a (a is not repeatable: bisecting its run-to-run noise)", noise_a, a2
                self.resume_step = None
            elif not noise_b.identical:
                compared, report, a, b = "b vs b (b is not repeatable: bisecting its run-to-run noise)", noise_b, b, b2
                self.resume_step = None
            else:
                report = self.compare(dirs["a"], dirs["b"])
            if not (noise_a.identical and noise_b.identical):
                self.notes.append(compared)
        self._sides = {"a": a, "b": b}
        if report.verdict is Verdict.INCOMPLETE:
            raise SamebitsError(f"the steps stage compared nothing ({'; '.join(report.notes)}): no verdict. "
                                f"Its runs and logs are in {self.out}.")
        first = self.conclude(stage, report)
        result = BisectResult(Verdict.IDENTICAL if report.identical else Verdict.DIVERGED, None, self.stages,
                              str(self.out), compared, repeatable, notes=self.notes)
        replicas = find_replica_mismatch(dirs["a"])
        if replicas is not None:  # one run against itself: its data-parallel replicas disagree
            names = ", ".join(replicas.params[:4]) + (f" and {len(replicas.params) - 4} more"
                                                      if len(replicas.params) > 4 else "")
            result.verdict = Verdict.DIVERGED
            result.compared = "ranks of run a (data-parallel replicas)"
            result.conclusion = (f"replicas differ: at step {replicas.step}, {names} get the same reduced gradient "
                                 f"on ranks {replicas.ranks} but hold different values there: the model was "
                                 "initialised differently per rank (a seed that depends on the rank before the "
                                 "model is built) or its weights were never broadcast; build it from one seed on "
                                 "every rank, or broadcast rank 0's weights")
            result.origin = Origin(rank=replicas.ranks[-1], step=replicas.step, classification="origin",
                                   category="state", phase="init", event_id="params", detail=result.conclusion,
                                   kind="replicas", conclusion=result.conclusion, params=replicas.params,
                                   ranks=replicas.ranks)
            result.seconds = time.perf_counter() - start
            return result
        if first is None:
            pairs = STEPS_ATTEMPTS if self.same_command else 1
            result.conclusion = ("identical: every recorded step matched bit for bit on every rank"
                                 + (f", in {pairs} pairs of runs" if pairs > 1 else ""))
            result.seconds = time.perf_counter() - start
            return result
        result.origin = self._reconcile(self._narrow(_earliest(report), result))
        result.conclusion = result.origin.conclusion
        parted = next((s.finding for s in reversed(self.stages) if s.finding is not None and s.finding.parted), None)
        if result.control_flow is None and parted is not None:
            result.control_flow = _control_flow(parted)
        result.seconds = time.perf_counter() - start
        return result

    def _narrow(self, first: OriginFinding, result: BisectResult) -> Origin:
        step = first.step
        shortcut = self._shortcut(first, result)
        if shortcut is not None:
            return shortcut
        evidence = _Evidence()
        if first.classification == "origin" and first.category == "collective":
            return self._finish(first, None, evidence)
        found = self._traced_rerun("modules", 2, step, step, evidence)
        if found is None:
            evidence.reproduced = False
            return self._finish(first, None, evidence)
        shortcut = self._shortcut(found, result)
        if shortcut is not None:
            return shortcut
        step = found.step
        if found.classification == "origin" and found.category == "collective":
            return self._finish(found, None, evidence)
        if found.classification == "origin" and found.category == "module" and found.phase in ("forward", "recompute"):
            evidence.module_origin = found
        subtree = _subtree_for(found)
        evidence.subtree = subtree
        module_finding = found
        found = self._traced_rerun("ops", 3, step, step, evidence, module=subtree, call_sites=True,
                                   where=f"module {subtree or '(whole model)'}, with call sites")
        if (found is not None and subtree and evidence.module_origin is None
                and not (found.classification == "origin" and found.category in ("op", "probe", "collective"))):
            # The difference entered the subtree from outside it: look at the whole model.
            self.notes.append(f"no op inside {subtree} is an origin ({found.classification} at {found.where()}); "
                              "tracing the whole model")
            subtree = evidence.subtree = ""
            found = self._traced_rerun("ops", 3, found.step, found.step, evidence, module="", call_sites=True,
                                       where="module (whole model), with call sites")
        if found is None:
            evidence.reproduced = False
            return self._finish(module_finding, None, evidence)
        shortcut = self._shortcut(found, result)
        if shortcut is not None:
            return shortcut
        if found.classification == "origin" and found.category in ("op", "probe", "collective"):
            return self._finish(found, subtree, evidence)
        evidence.ops_finding = found
        return self._finish(found, None, evidence)

    def _shortcut(self, found: OriginFinding, result: BisectResult) -> Origin | None:
        """Findings that end the bisection where they are seen."""
        if found.classification == "control_flow":
            result.control_flow = _control_flow(found)
            anchor = self._anchor(found.step)
            if (self.resume_step is not None and found.step == self.resume_step and found.phase == "optimizer"
                    and anchor is not None and anchor[1].phase == "optimizer"):
                return self._optimizer_state(found, anchor)
            return Origin.of(found, None, "control_flow",
                                f"the runs take different paths at step {found.step} on rank {found.rank}: "
                                f"{found.parted or found.detail}")
        if found.classification == "order":
            return self._explain_order(found)
        if found.category == "phase" and found.role == "in" and (found.event_id or "").startswith("forward/"):
            root = found.event_id.partition("/")[2].rpartition(":")[0]
            model = "the model's forward" if root == "model" else f"the forward of top-level module {root}"
            text = (f"the input batch differs at step {found.step} (input {found.label} of {model}, on rank "
                    f"{found.rank}): the origin is before the model (data loader / dataset / sampler)")
            generators = _torch_generators(found)
            if generators:  # the batch was drawn from a torch generator that was already in another state
                return Origin.of(found, None, "generator",
                                    "; ".join(describe_state_record(name) for name in generators)
                                    + f". So {text[0].lower()}{text[1:]}", state_differs=generators)
            return Origin.of(found, None, "input_batch", text + self._state_sentence(found, ". Also: "))
        if found.category in ("op", "probe") and found.permuted:
            site = f" at {found.call_site}" if found.call_site else ""
            return Origin.of(found, None, "order",
                                f"same values, different order: {found.op}{site} (step {found.step}, phase "
                                f"{found.phase}, rank {found.rank}) received the same tensors in another order "
                                f"({found.detail}). Something iterated in an order that changes between runs "
                                "feeds it (a Python set, PYTHONHASHSEED, a dict keyed by ids, a file listing)")
        if found.category == "collective" and found.permuted:
            site = found.call_site or self._collective_site(found)
            found.call_site = site
            op = (found.event_id or "").rpartition("/")[2].rpartition(":")[0]
            return Origin.of(found, None, "order",
                                f"same values, different order: at step {found.step} on rank {found.rank} the "
                                f"{op} calls{' at ' + site if site else ''} received the same tensors in another "
                                "order (the collective order differs). The calls are issued in an order that "
                                "changes between runs (a Python set, PYTHONHASHSEED, a dict keyed by ids): every "
                                "rank must issue its collectives in one fixed order")
        if found.classification == "origin" and found.category == "state":
            return Origin.of(found, None, "initial_state",
                                f"the parameters differ before step {found.step}, the first traced step "
                                f"({found.label} on rank {found.rank}): initialisation (its seed) or the "
                                "loaded checkpoint differs, so no training op is the origin")
        # Python's and NumPy's generators differ between any two processes that do not seed them
        # (and never feed an ATen op): they are no evidence of what a resume restores.
        names = [name for name in found.state_differs if not name.startswith("rng.")]
        if self.from_step is not None and found.step == self.from_step and names and not _torch_generators(found):
            # B resumed at this step, each side repeats itself, and the state census taken at the
            # step's start, before any op, already differs: what the checkpoint saves and restores.
            # (A torch generator that differs is narrowed on instead: to the RNG op that draws from it.)
            listed = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
            return Origin.of(found, None, "resume_state",
                           f"the resumed run starts step {found.step} in another state than the run it resumes "
                           f"(rank {found.rank}): {listed} differ at the step's start, before any op ran, and each "
                           "side repeats itself: the checkpoint does not save or restore them. "
                           + self._describe(names[0], found),
                           state_differs=names)
        return None

    def _describe(self, name: str, finding: OriginFinding) -> str:
        """The sentence for census record ``name`` that differs at ``finding``'s step start,
        naming only what the program has (its census there: `describe_state_record`)."""
        return describe_state_record(name, self.census_present.get((finding.rank, finding.step)))

    def _state_sentence(self, finding: OriginFinding, prefix: str) -> str:
        if not finding.state_differs:
            return ""
        return prefix + "; ".join(self._describe(name, finding) for name in finding.state_differs) + "."

    def _reconcile(self, origin: Origin) -> Origin:
        """The conclusion may never contradict an earlier stage's evidence.  A stage that found
        "phase P of step S: inputs matched, output differs" bounds every later one: a final
        kind about step S must be about phase P (an op, a probe, a collective, an ordering,
        different ops, all in P), or about the state the step started from (`resume_state`),
        or not localised.  A conclusion about another phase of that step (an earlier op whose
        difference vanished, a resume's leftovers) explains nothing of P's difference: it
        becomes `not_localised`, saying what the stages found and what was ruled out."""
        if origin.kind in ("resume_state", "not_localised", "replicas"):
            return origin
        anchor = self._anchor(origin.step)
        if anchor is None:
            return origin
        number, evidence = anchor
        if _same_phase(evidence.phase, origin.phase):
            return origin
        stage = self.stages[number - 1]
        self.notes.append(f"stage {number} ({stage.name}) found phase {evidence.phase} at step {evidence.step} to be "
                          f"where inputs matched and the output differs; the finer stages concluded {origin.kind} in "
                          f"phase {origin.phase}, which cannot explain it: not localised")
        text = (f"not localised: stage {number} ({stage.name}, rung {stage.rung}) found the first difference at "
                f"{evidence.where()}: {evidence.detail}; but the finer stages' first difference is in phase "
                f"{origin.phase} ({origin.kind}: {origin.conclusion}), outside phase {evidence.phase}, so it does "
                f"not explain it. Ruled out: every value recorded before phase {evidence.phase} of step "
                f"{evidence.step} matched; the difference arises in phase {evidence.phase}, from a value its trace "
                "does not record (state kept across steps, or code outside torch)")
        return Origin.of(evidence, None, "not_localised", text + self._state_sentence(evidence, " Also: "))

    def _anchor(self, step: int) -> tuple[int, OriginFinding] | None:
        """The earliest stage's evidence at ``step``: (stage number, finding) of the first stage
        that found an event there whose inputs matched and whose output differs."""
        for number, stage in enumerate(self.stages, 1):
            found = stage.finding
            if found is not None and found.classification == "origin" and found.step == step \
                    and found.category != "state":
                return number, found
        return None

    def _optimizer_state(self, found: OriginFinding, anchor: tuple[int, OriginFinding]) -> Origin:
        """A resume bisect whose optimizer step, given the same gradients and parameters (an
        earlier stage: its inputs matched, its output differs), runs other ops than the run it
        resumes: the optimizer's own state (moments, momentum buffers) was not restored."""
        number, evidence = anchor
        a_has = describe_record(found.a)
        b_has = describe_record(found.b)
        return Origin.of(found, None, "resume_state",
                       f"the resumed run's optimizer state differs at step {found.step} (rank {found.rank}): its "
                       f"optimizer step got the same gradients and parameters (stage {number}: "
                       f"{evidence.detail}) but runs other ops than the run it resumes (a: {a_has}; b: {b_has}): "
                       "the optimizer's own state (momentum buffers, moments, step counts) is not saved or "
                       "restored by the checkpoint (optimizer.load_state_dict)", state_differs=[])

    def _explain_order(self, found: OriginFinding) -> Origin:
        """Same values, another order: say what was reordered, and where it comes from."""
        reordered = found.reordered
        if reordered is not None and _is_optimizer_order(found):
            site = found.call_site or self._event_site(found)
            found.call_site = site
            return Origin.of(found, None, "order",
                           f"same values, different order: the optimizer's parameters are in another order at step "
                           f"{found.step} (rank {found.rank}): it holds the same parameters with the same values, "
                           f"in another order (a: {_some(reordered['a'])}; b: {_some(reordered['b'])})"
                           + (f", for the optimizer built at {site}" if site else "")
                           + ". Its param groups are built from something iterated in an order that changes between "
                           "runs (a Python set, PYTHONHASHSEED, a dict keyed by ids): nothing differs in value yet, "
                           "but whatever follows that order does (clipping or foreach kernels over the list, and "
                           "its state_dict: a checkpoint's state goes to other parameters)")
        what = f": {found.detail}" if found.detail else ""
        return Origin.of(found, None, "order",
                       f"same values, different order: the runs recorded the same values in another order at step "
                       f"{found.step} (rank {found.rank}){what}. Something iterated in an order that changes between "
                       "runs (a Python set, a dict keyed by ids, hooks or threads) decides it")

    def _event_site(self, found: OriginFinding) -> str | None:
        """The call site of a rung-1 event (an optimizer's: where it was built)."""
        return self._site_of(found, "phase events", lambda f: f.category == found.category
                             and f.event_id == found.event_id)

    def _collective_site(self, found: OriginFinding) -> str | None:
        """The call site of a collective."""
        return self._site_of(found, "collectives", lambda f: f.category == "collective")

    def _site_of(self, found: OriginFinding, what: str, matches) -> str | None:
        """One re-run of ``found``'s step at rung 1 with call sites: the call site of the first
        finding that ``matches``."""
        stage = Stage("sites", "phases", f"step {found.step}, call sites of {what}, then stop")
        config = self.base_config(step_start=found.step, step_stop=found.step + 1, stop_after=found.step,
                                  call_sites=True)
        dirs = self.run_stage(stage, config, self.sides())
        report = self.compare(dirs["a"], dirs["b"])
        self.conclude(stage, report)
        return next((f.call_site for f in report.findings.values() if f.call_site and matches(f)), None)

    def _traced_rerun(self, name: str, level: int, first_step: int, last_step: int | None, evidence: _Evidence,
                      where: str = "", **changes) -> OriginFinding | None:
        """Re-run both sides traced at ``level`` over steps first_step..last_step (stopping after
        last_step) until the re-run diverges inside that window.  A re-run that diverges
        earlier widens the window back to the earliest divergent step seen; one that does not
        diverge is tried again, traced to the end of the run.  None when no attempt
        reproduced a divergence."""
        start = first_step
        for attempt in range(MAX_RERUNS):
            if last_step is None:  # a re-run that did not diverge: trace to the end of the run
                window, stop = f"steps {start}..end", {"step_stop": None, "stop_after": self.stop_after}
            else:
                window = f"step {start}" if start == last_step else f"steps {start}..{last_step}"
                window, stop = window + ", then stop", {"step_stop": last_step + 1, "stop_after": last_step}
            stage = Stage(name, LEVEL_NAMES[level], ", ".join(filter(None, [window, where])))
            config = self.base_config(level=level, step_start=start, **stop, **changes)
            dirs = self.run_stage(stage, config, self.sides())
            report = self.compare(dirs["a"], dirs["b"])
            self.conclude(stage, report)
            if not report.findings:
                self.notes.append(f"the {name} stage's re-run (attempt {attempt + 1}) did not diverge "
                                  + (f"up to step {last_step}" if last_step is not None else "at all")
                                  + ": the divergence is intermittent; tracing to the end of the run")
                last_step = None
                continue
            found = _earliest(report)
            stage.finding = found
            if found.step < start:
                self.notes.append(f"the {name} stage's re-run diverged at step {found.step}, before the traced "
                                  f"step {start}: a nondeterminism that fires at a random step; tracing again "
                                  f"from step {found.step}")
                stage.summary = f"diverged earlier, at step {found.step} (untraced there)"
                start = found.step
                continue
            return found
        return None

    def _finish(self, final: OriginFinding, subtree: str | None, evidence: _Evidence) -> Origin:
        """The origin object and its conclusion, with the dump for an op, probe or collective."""
        elements = None
        rng_op = final.category == "op" and final.op in RNG_OPS  # its conclusion needs no element data
        if final.classification == "origin" and final.category in ("op", "collective", "probe") and not rng_op:
            elements = self._dump(final, subtree)
        if not evidence.reproduced:
            return Origin.of(final, None, "not_localised",
                                f"not localised: the runs first differ at step {final.step} ({final.where()}), "
                                f"but {MAX_RERUNS} re-runs at a finer rung did not diverge again (a rare race); "
                                "run the bisect again, or with more steps")
        if final.classification == "origin" and final.category in ("op", "probe", "collective"):
            if elements is not None and not elements.differing:
                # The dumps hold no difference: the origin rests on the trace's digests, and the
                # dumps' equal outputs are no element detail of it ("0 of N differ, max 0 ulp").
                origin = self._explain_origin(final, None)
                origin.conclusion += (f". Its dumps did not reproduce the difference: output {elements.output} of "
                                      f"{final.op or final.event_id} was equal in the dump runs "
                                      f"({' vs '.join(elements.pair)}, {elements.total} elements), so the "
                                      "difference did not recur there (a race that fires only sometimes); no "
                                      "element detail. Run the bisect again for it")
                return origin
            return self._explain_origin(final, elements)
        if evidence.module_origin is not None and evidence.ops_finding is not None:
            module = evidence.module_origin
            ops = evidence.ops_finding
            return Origin.of(module, None, "below_dispatcher",
                                f"below the dispatcher: module {module.module or '(root)'} (step {module.step}, "
                                f"rank {module.rank}) received identical inputs and its output differs, yet no "
                                f"ATen op inside it is an origin (rung 3's first difference there: {ops.where()}, "
                                f"{ops.classification}: {ops.detail}). A call the dispatcher does not see inside "
                                "it (a custom kernel, a C++ extension, a library call) made the difference: put "
                                "a samebits.trace.TraceProbe around that call")
        ruled_out = ["the initial parameters matched", "the model's inputs matched up to the divergent step"]
        if evidence.subtree is not None:
            ruled_out.append(f"no ATen op in {evidence.subtree or 'the whole model'} at step {final.step} has "
                             "matching inputs and a differing output")
        text = (f"not localised: the first difference is {final.where()} ({final.classification}: {final.detail}). "
                "Ruled out: " + "; ".join(ruled_out) + ". The value was written by code the trace does not "
                "cover here (outside the traced module subtree, or outside torch)")
        return Origin.of(final, None, "not_localised", text + self._state_sentence(final, " Also: "))

    def _explain_origin(self, final: OriginFinding, elements: Elements | None) -> Origin:
        site = f" at {final.call_site}" if final.call_site else ""
        what = f"{final.op or final.event_id}{site}"
        if final.category == "op" and final.op in RNG_OPS:
            generators = _torch_generators(final)
            if generators:
                text = "; ".join(describe_state_record(name) for name in generators)
                return Origin.of(final, elements, "generator",
                                    f"{text} (step {final.step}, rank {final.rank}): the RNG op {what} drew "
                                    "different numbers from identical inputs", state_differs=generators)
            return Origin.of(final, elements, "generator",
                                f"the RNG op {what} drew different numbers from identical inputs at step "
                                f"{final.step} on rank {final.rank}: the generator it draws from was in another "
                                "state (a torch.Generator passed to it, seeded from something that changes, or "
                                "not restored on resume)")
        if elements is not None and not elements.inputs_identical:
            # The trace saw every input recorded before the op match; its dumps say otherwise.
            if elements.inputs_permuted:
                return Origin.of(final, elements, "order",
                               f"same values, different order: {what} (step {final.step}, phase {final.phase}, rank "
                               f"{final.rank}) was given the same input tensors in another order (its dumps: "
                               f"inputs {', '.join(elements.inputs_differ[:6])} hold each other's values). Something "
                               "iterated in an order that changes between runs feeds it (a Python set, "
                               "PYTHONHASHSEED, a dict keyed by ids, a file listing)")
            return Origin.of(final, elements, "not_localised",
                           f"not localised: the first difference is the output of {what} (step {final.step}, phase "
                           f"{final.phase}, rank {final.rank}), but its dumps show its inputs differ "
                           f"({', '.join(elements.inputs_differ[:6])}) although every value recorded before it "
                           "matched: a value computed before it reached it through another argument, so it is not "
                           "the origin. Ruled out: every traced value before it at that step")
        if elements is not None and elements.same_values:
            return Origin.of(final, elements, "order",
                                f"same values, different order: the output of {what} (step {final.step}, rank "
                                f"{final.rank}) holds the same values in another order. Something iterated in an "
                                "order that changes between runs feeds it (a Python set, a dict keyed by ids, "
                                "PYTHONHASHSEED, a file listing)")
        kind = {"op": "op", "probe": "probe", "collective": "collective"}[final.category]
        text = f"origin: {what} (step {final.step}, phase {final.phase}, rank {final.rank}): {final.detail}"
        if final.catalog:
            text += f". Known: {final.catalog}"
        return Origin.of(final, elements, kind, text)

    def _dump(self, final: OriginFinding, subtree: str | None) -> Elements | None:
        step = final.step
        spec = EventSpec(step, final.rank, final.event_id, final.phase)
        if final.category == "op":
            config = self.base_config(level=3, step_start=step, step_stop=step + 1, stop_after=step,
                                      module=subtree or "", dump=spec)
        else:
            config = self.base_config(level=1, step_start=step, step_stop=step + 1, stop_after=step, dump=spec)
        dumps: list[tuple[str, Path]] = []
        elements = None
        for attempt in range(2):  # an intermittent origin may not fire in one pair of runs
            stage = Stage("dump", LEVEL_NAMES[config.level], f"step {step}, save {final.event_id} on rank {final.rank}")
            dirs = self.run_stage(stage, config, self.sides())
            for label in ("a", "b"):
                path = dirs[label] / dump_filename(final.rank, step)
                if path.exists():
                    dumps.append((f"{label}{attempt + 1}", path))
            elements = _first_difference(dumps)
            stage.verdict = str(Verdict.DIVERGED if elements and elements.differing else Verdict.IDENTICAL)
            if elements is None:
                stage.summary = "no dump was written (the event did not run)"
            elif not elements.differing:
                stage.summary = (f"the difference did not recur: output {elements.output} equal in "
                                 f"{' vs '.join(elements.pair)} ({elements.total} elements)")
            else:
                stage.summary = (f"{elements.differing} of {elements.total} elements differ in output "
                                 f"{elements.output} ({' vs '.join(elements.pair)}), "
                                 f"max {elements.max_ulp} ulp"
                                 + (", same values in another order" if elements.same_values else ""))
            self.say(f"      -> {stage.summary}")
            if elements is not None and elements.differing:
                return elements
        self.notes.append("the dump runs did not reproduce a difference at the origin (it is intermittent); "
                          "its element detail is empty")
        return elements


def _earliest(report: OriginReport) -> OriginFinding:
    """The finding to narrow: the earliest step of any rank, and there the earliest origin
    (or, without one, the earliest finding)."""
    first_step = min(f.step for f in report.findings.values())
    at_step = [f for f in report.findings.values() if f.step == first_step]
    origins = [f for f in at_step if f.classification == "origin"]
    return min(origins or at_step, key=OriginFinding.sort_key)


def _check_compared(dirs: dict[str, Path]) -> None:
    """A verdict needs something compared: every run must have recorded at least one step."""
    for label, directory in dirs.items():
        run = open_run(directory)
        for rank in run.ranks:
            reader = run.stream(rank)
            try:
                has_step = next(iter(reader.steps()), None) is not None
            finally:
                reader.close()
            if not has_step:
                raise SamebitsError(f"run {label} recorded no step on rank {rank} ({directory}): nothing to compare. "
                                    "Does the command reach optimizer.step()? Its log is under logs/.")


def _torch_generators(finding: OriginFinding) -> list[str]:
    """The torch generators among the census records that differ at the finding's step start
    (ATen ops draw from these; Python's and NumPy's generators never feed them)."""
    return [name for name in finding.state_differs if name.startswith(_TORCH_GENERATORS)]


def _subtree_for(found: OriginFinding) -> str:
    """Where rung 3 looks, given the modules stage's finding."""
    if found.category == "module" and found.module is not None:
        if found.event_id and found.event_id.endswith("@grad"):
            return ""  # a parameter's gradient: the ops using it may sit anywhere
        if found.classification == "origin" and found.phase in ("forward", "recompute"):
            return found.module
        if found.classification == "origin":
            return parent_scope(found.module)  # backward: an input's gradient totals its consumers'
        return ""  # a value that arrived different: its writer may sit anywhere in the model
    if found.category == "probe" and found.module is not None:
        return found.module
    return ""


def _first_difference(dumps: list[tuple[str, Path]]) -> Elements | None:
    """Element detail of the first pair of dumps whose outputs differ: pairs of an A and a B
    run first, then runs of one side (an intermittent origin may differ between any two)."""
    loaded = [(label, torch.load(path, map_location="cpu", weights_only=True), path) for label, path in dumps]
    pairs = [(x, y) for i, x in enumerate(loaded) for y in loaded[i + 1:]]
    pairs.sort(key=lambda pair: pair[0][0][0] == pair[1][0][0])  # a-vs-b pairs first
    chosen = None
    for (label_a, dump_a, path_a), (label_b, dump_b, path_b) in pairs:
        for label, out_a in dump_a["outputs"].items():
            out_b = dump_b["outputs"].get(label)
            if out_b is None:
                continue
            detail = compare_elements(out_a, out_b)
            differ = _differing_inputs(dump_a["inputs"], dump_b["inputs"])
            elements = Elements(
                detail, label, [label_a, label_b], [str(path_a), str(path_b)],
                same_values=bool(detail["differing"]) and same_values(out_a, out_b),
                inputs_identical=not differ, inputs_differ=differ,
                inputs_permuted=bool(differ) and _same_tensors(dump_a["inputs"], dump_b["inputs"]))
            if chosen is None:
                chosen = elements
            if elements.differing:
                return elements
    return chosen


def _differing_inputs(inputs_a: dict, inputs_b: dict) -> list[str]:
    """The labels of the dumped inputs that differ (in value, shape or presence) between two dumps."""
    differ = []
    for name in list(inputs_a) + [n for n in inputs_b if n not in inputs_a]:
        a, b = inputs_a.get(name), inputs_b.get(name)
        if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape \
                or compare_elements(a, b)["differing"]:
            differ.append(name)
    return differ


def _same_tensors(inputs_a: dict, inputs_b: dict) -> bool:
    """Both dumps hold the same input tensors (bit for bit), whatever their positions."""
    def contents(inputs):
        return sorted((str(t.dtype), tuple(t.shape),
                       hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).digest())
                      for t in inputs.values())
    return len(inputs_a) == len(inputs_b) and contents(inputs_a) == contents(inputs_b)


def _same_phase(evidence: str | None, final: str | None) -> bool:
    """A finer stage's phase is about the evidence's phase (recomputation runs in backward)."""
    def norm(phase):
        return "backward" if phase == "recompute" else phase
    return evidence is None or norm(evidence) == norm(final)


def _is_optimizer_order(found: OriginFinding) -> bool:
    """An order finding over what the optimizer holds in its parameter order: the gradients it
    is given and its parameters and state after the step (traced ``reduce:N``/``optimizer:N``,
    or zero-code recording's ``grads``, ``params`` and ``optimizer`` records)."""
    if found.category == "phase":
        return (found.event_id or "").startswith(("reduce:", "optimizer:"))
    phase = (found.phase or "").rpartition(".")[2]
    return found.category == "record" and phase in ("grads", "params", "optimizer")


def _some(labels: list[str], n: int = 4) -> str:
    return ", ".join(labels[:n]) + (f", ... ({len(labels)} in all)" if len(labels) > n else "")


def _control_flow(finding: OriginFinding) -> ControlFlow:
    return ControlFlow(finding.step, finding.rank, finding.parted or finding.detail)


def bisect(cmd_a: list[str] | None = None, cmd_b: list[str] | None = None, *, out=None,
           program: SelfRecording | None = None, stop_after: int | None = None,
           run_timeout: float | None = 1800, b_step_offset: int | None = None,
           resume_at: int | None = None, progress: Callable[[str], None] | None = None,
           spec: settings.RecordingSpec | None = None) -> BisectResult:
    """Find where two runs part, and the op that is the origin.

    * ``program``: a program that records itself (the reference recipe, as in ``samebits
      verify``: `samebits.recipes.commands`), run twice; with ``resume_at`` K, its resume, as
      `samebits verify`'s runs A and C: one run saves the checkpoint of step K (under
      ``out``/ckpt), every B resumes it, every A runs through; only steps >= K are compared
      and traced;
    * ``cmd_a`` only: that command twice (its run-to-run nondeterminism);
    * ``cmd_a`` and ``cmd_b``: each checked for repeatability, then A against B.

    ``stop_after``: end every run after that step (a long command).  ``run_timeout``: seconds
    one run may take before it is killed (with every process it started) and reported as a
    hang.  ``b_step_offset``: side B resumes at step K (its steps are numbered from K, as
    ``samebits verify --resume-at K`` numbers run C); both sides record, and every stage
    compares and traces, only steps >= K, so A's steps before the resume are no divergence.
    ``{out}`` and ``{run}`` in a command are filled per run, as `samebits verify` fills them:
    a work folder of its own, new and empty (``out``/work/STAGE/SIDE), and the side's label; in
    B's command with ``b_step_offset`` K, ``{step}`` is K and ``{from}`` the work folder of the
    bisect's first run of A (where it saved the checkpoints every B resumes).  ``spec``: what
    every run records (default: the environment's ``SAMEBITS_*`` choice, e.g. SAMEBITS_EXCLUDE).
    Output (streams, logs, dumps) goes under ``out``, which must be new or empty.
    A run that crashes raises `SamebitsError` (the CLI exits 2): never a verdict.
    """
    if cmd_b is not None and not cmd_a:
        raise ConfigError("--b needs --a: give both commands to compare, or one command after --.")
    if b_step_offset is not None:
        if not cmd_a or cmd_b is None:
            raise ConfigError("--b-step-offset needs --a and --b: the run to resume from (A) and the command "
                              "that resumes it at that step (B); for the reference recipe's resume, --resume-at K.")
        if b_step_offset < 0:
            raise ConfigError(f"--b-step-offset {b_step_offset}: a step number cannot be negative; give the "
                              "step the resumed command B starts from (as in --resume-at K).")
    if resume_at is not None:
        if cmd_a:
            raise ConfigError("--resume-at bisects the reference recipe's resume; for your own commands give "
                              "--a (the run that saves), --b (the command that resumes) and --b-step-offset K.")
        steps = program.steps if program is not None else None
        if steps is not None and not 0 < resume_at < steps:
            raise ConfigError(f"--resume-at {resume_at} must be between 1 and {steps - 1} (inside the run of "
                              f"--steps {steps}).")
    for words, side in ((cmd_a or [], "--a"), (cmd_b or [], "--b")):
        for placeholder in (STEP, FROM):
            if holds(words, placeholder) and (side == "--a" or b_step_offset is None):
                raise ConfigError(f"{side} holds {placeholder}, which only a resumed command B can use (with "
                                  f"--b-step-offset K: {STEP} is K, {FROM} the work folder of the bisect's "
                                  "first run of A); use {out} for a run's own work folder.")
    if (program is None) == (not cmd_a):
        raise ConfigError("bisect: give a command (or --a and --b) or the program to run, not both"
                          if program is not None else "bisect: no command given: write `samebits bisect -- python "
                          "train.py ...`, or --a 'CMD' --b 'CMD'.")
    out = check_out_dir(out if out is not None else default_out_dir("bisect"))
    if program is not None:
        program.refuse_early()  # before any run and any folder
    out.mkdir(parents=True, exist_ok=True)
    if program is not None:
        same = resume_at is None
        side_a = Command("a", list(program.record), recipe=True)
        side_b = Command("b", list(program.record), recipe=True)
        if resume_at is not None:
            ckpt = _save_checkpoint(program, resume_at, out, run_timeout, progress)
            side_a = Command("a", list(program.record), recipe=True, from_step=resume_at)
            side_b = Command("b", fill_placeholders(program.resume, {CKPT: ckpt}), recipe=True,
                             step_offset=resume_at, from_step=resume_at)
    else:
        side_a = Command("a", list(cmd_a), from_step=b_step_offset, spec=spec)
        same = cmd_b is None
        side_b = Command("b", list(cmd_a if cmd_b is None else cmd_b), step_offset=b_step_offset,
                         from_step=b_step_offset, spec=spec)
    bisector = _Bisector(side_a, side_b, out, progress, stop_after, same, run_timeout)
    try:
        result = bisector.bisect()
    except SamebitsError as err:
        _add_earlier_stages(err, bisector.stages)
        raise
    write_summary(out, result)
    return result


def _add_earlier_stages(err: SamebitsError, stages: list[Stage]) -> None:
    """A bisect that cannot go on (a run failed, exit 2) keeps what its finished stages found
    (issue 35): the first divergence they located is often the answer the user came for, and
    an error that shows only the failed run hides it.  Written into ``err``'s message (its
    type and attributes kept); nothing when no stage finished."""
    done = [(number, stage) for number, stage in enumerate(stages, 1) if stage.verdict]
    if not done or not err.args:
        return
    stopped = len(stages) if len(stages) > len(done) else None
    lines = [f"bisect stopped{f' in stage {stopped} ({stages[stopped - 1].name})' if stopped else ''} "
             "(its error below); the stages before it found:"]
    for number, stage in done:
        lines.append(f"  stage {number} ({stage.name}, rung {stage.rung}, {stage.scope}): {stage.summary or stage.verdict}")
        if stage.finding is not None and stage.finding.detail:
            lines.append(f"    {stage.finding.detail}")
    err.args = ("\n".join(lines + [str(err.args[0])]), *err.args[1:])


def _save_checkpoint(program: SelfRecording, step: int, out: Path, timeout: float | None,
                     progress: Callable[[str], None] | None) -> Path:
    """Run the program once up to ``step`` and save its checkpoint there (`samebits verify`'s
    run C before its resume), untraced and unrecorded: every B of the bisect resumes from it,
    while every A runs through from step 0.  Returns the checkpoint root."""
    ckpt, log = out / "ckpt", out / "logs" / "save.log"
    save = fill_placeholders(program.save_only, {STEP: step, CKPT: ckpt})
    (progress or (lambda message: None))(f"[0] save   the checkpoint of step {step} that every run b resumes ...")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    code, _ = run_logged(save, log, env=env, timeout=timeout, label="save")
    if code != 0 or not (ckpt / f"step-{step}").is_dir():
        raise failed("save", save, code, log, why="" if code else f"it saved no checkpoint of step {step} in {ckpt}")
    return ckpt
