"""How `samebits bisect` narrows a divergence: `Side` runs one side (a program in a role, traced
as each stage asks); `_Bisector` runs the stages and re-runs a step at a finer rung until it has
the origin, leaving the words to `samebits.runners._bisect_prose.Conclusions`.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from samebits import settings
from samebits.errors import SamebitsError
from samebits.runners._bisect_prose import MAX_RERUNS, Conclusions, _control_flow, _Evidence
from samebits.runners._bisect_result import BisectResult, Elements, Origin, Stage
from samebits.runners._explain import census_names, census_suspects
from samebits.runners._launch import failed, run_logged, teardown_note
from samebits.runners.commands import FROM, STEP
from samebits.runners.program import RECORD, Program
from samebits.stream.reader import open_run
from samebits.trace import (ENV_VARS, LEVEL_NAMES, EventSpec, OriginFinding, OriginReport, TraceConfig,
                            compare_elements, dump_filename, find_origins, find_replica_mismatch, parent_scope,
                            same_values)
from samebits.verdicts import Verdict

STEPS_ATTEMPTS = 2  # pairs of runs of one command before it is called identical


@dataclass
class Side:
    """How to run one side: ``program`` in ``role``, ``values`` filling its placeholders.  A resumed
    side (``step_offset`` K) gets ``{step}`` K and ``{from}`` (A's first work folder); every run
    gets a new, empty work folder as ``{out}``, so a trainer that resumes from its output
    folder starts clean."""

    label: str
    program: Program
    role: str = RECORD
    values: dict = field(default_factory=dict)
    step_offset: int | None = None  # a resumed side: its first step number
    from_step: int | None = None  # record only steps >= this
    exit_notes: list[str] = field(default_factory=list)

    def again(self, label: str) -> "Side":
        """The same side under another label (a second run of it)."""
        return replace(self, label=label, exit_notes=[])

    def launch(self, out_dir: Path, config: TraceConfig, log: Path, timeout: float | None = None,
               progress: Callable[[str], None] | None = None, work: Path | None = None,
               resumes: Path | None = None) -> float:
        """Run once, recording into ``out_dir``, traced as ``config`` says; ``resumes``: its ``{from}``."""
        values = dict(self.values)
        if self.step_offset is not None:
            values[STEP] = self.step_offset
        if resumes is not None:
            values[FROM] = resumes
        run = self.program.launch(self.role, out_dir, work=work, values=values, step_offset=self.step_offset,
                                  from_step=self.from_step)
        argv, env = run.argv, dict(run.env if run.env is not None else os.environ)
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


class _Bisector(Conclusions):
    def __init__(self, side_a: Side, side_b: Side, out: Path, progress, stop_after: int | None,
                 same_command: bool, run_timeout: float | None = None):
        self.run_timeout = run_timeout
        self.side_a, self.side_b = side_a, side_b
        self.out = out
        self.say = progress or (lambda message: None)
        self.progress = progress  # also follows each run's steps live (`samebits.runners.progress`)
        self.stop_after = stop_after
        self.same_command = same_command
        self.stages: list[Stage] = []
        self.notes: list[str] = []
        #: (rank, step) -> every census record name of side a there (None: no census), so that a
        #: conclusion names only components the program has
        self.census_present: dict[tuple[int, int], set[str] | None] = {}
        self._sides: dict[str, Side] = {"a": side_a, "b": side_b}
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

    def run_stage(self, stage: Stage, config: TraceConfig, sides: list[tuple[str, Side]]) -> dict[str, Path]:
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
            if self.first_a_work is None and label == "a":
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

    def sides(self) -> list[tuple[str, Side]]:
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
            a2 = a.again("a2")
            b2 = b.again("b2")
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
            if next(run.steps(rank), None) is None:
                raise SamebitsError(f"run {label} recorded no step on rank {rank} ({directory}): nothing to compare. "
                                    "Does the command reach optimizer.step()? Its log is under logs/.")


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
