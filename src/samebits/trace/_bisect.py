"""`bisect`: narrow a divergence between two runs to its origin op, one rung at a time.

Stages (each runs side A and side B once, in this order, and stops as soon as it can):

1. ``steps``    rung 1 (phases, collectives, gradients, optimizer state) for the whole run:
   the first divergent step and phase.  Identical runs stop here.  With two different
   commands, each is first run twice (``repeat``) to separate run-to-run noise from the
   intended change; a side that is not repeatable is bisected against itself.
2. ``modules``  rung 2 for that step only, stopping after it: the first divergent module.
3. ``ops``      rung 3 inside that module's subtree (its parent's for a backward finding,
   since a module's input gradient is the total of its consumers'), with call sites.
4. ``dump``     the same run with the origin's inputs and outputs saved, compared element
   by element (how many differ, where, by how many ulps).

A collective origin found in stage 1 skips to the dump; an origin in the initial state
(step 0 parameters) stops there; runs whose recorded event sequences part are reported
where they part.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from samebits._launch import failed, run_logged, teardown_note
from samebits.errors import SamebitsError
from samebits.trace._config import ENV_VARS, LEVEL_NAMES, EventSpec, TraceConfig, parent_scope
from samebits.trace._elements import compare_elements
from samebits.trace._origin import Finding, OriginReport, find_origins
from samebits.trace._tracer import dump_filename


@dataclass
class Command:
    """How to run one side: a command under zero-code recording, or the reference recipe."""

    label: str
    argv: list[str]
    recipe: bool = False  # pass --out DIR (the recipe records and traces itself)
    exit_notes: list[str] = field(default_factory=list)

    def launch(self, out_dir: Path, config: TraceConfig, log: Path, timeout: float | None = None) -> float:
        env = dict(os.environ)
        if self.recipe:
            argv = self.argv + ["--out", str(out_dir)]
        else:
            from samebits.autorecord import environment_for

            env = environment_for(out_dir, command=shlex.join(self.argv))
            argv = self.argv
        for name in ENV_VARS:
            env.pop(name, None)
        env.update(config.to_env())
        header = " ".join(f"{k}={v}" for k, v in sorted(config.to_env().items()))
        code, seconds = run_logged(argv, log, env=env, header=header, timeout=timeout, label=self.label)
        if not any(out_dir.glob("rank-*.sbs")):
            if code != 0:
                raise failed(self.label, self.argv, code, log)
            raise SamebitsError(f"run {self.label} recorded nothing into {out_dir}: is `{shlex.join(self.argv)}` "
                                "a PyTorch training script that calls optimizer.step()?")
        if code != 0:
            note = teardown_note(self.label, code, out_dir, log)
            if note is None:
                raise failed(self.label, self.argv, code, log)
            self.exit_notes.append(note)
        return seconds


@dataclass
class Stage:
    name: str
    rung: str
    scope: str  # what the stage traced, in words
    runs: dict[str, float] = field(default_factory=dict)  # label -> seconds
    verdict: str = ""
    finding: Finding | None = None
    summary: str = ""

    def to_json(self) -> dict:
        return {"name": self.name, "rung": self.rung, "scope": self.scope,
                "runs_s": {k: round(v, 2) for k, v in self.runs.items()}, "verdict": self.verdict,
                "finding": None if self.finding is None else self.finding.to_json(), "summary": self.summary}


@dataclass
class BisectResult:
    verdict: str  # "identical" | "diverged"
    origin: dict | None
    stages: list[Stage]
    out: str
    compared: str  # e.g. "a vs b", "a vs a (a is not repeatable)"
    repeatable: dict[str, bool] | None = None
    control_flow: dict | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"verdict": self.verdict, "origin": self.origin, "stages": [s.to_json() for s in self.stages],
                "compared": self.compared, "repeatable": self.repeatable, "control_flow": self.control_flow,
                "out": self.out, "notes": self.notes, "seconds": round(self.seconds, 1)}


def recipe_commands(*, steps: int = 4, nproc: int = 2, nondeterministic: bool = False,
                    overrides=()) -> tuple[Command, Command]:
    """Both sides on the reference recipe (the same command twice)."""
    argv = [sys.executable, "-m", "samebits.recipes.train"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
        "--nproc-per-node", str(nproc), "-m", "samebits.recipes.train"]
    argv += ["--steps", str(steps)]
    if nondeterministic:
        argv += ["--preset", "nondeterministic"]
    for item in overrides:
        argv += ["--set", item]
    wired = _recipe_traces_itself()
    return Command("a", argv, recipe=wired), Command("b", list(argv), recipe=wired)


def _recipe_traces_itself() -> bool:
    """True once the recipe's loop calls samebits.trace.attach_from_env; until then the
    recipe is traced like any command, through zero-code recording."""
    try:
        import inspect

        from samebits.recipes import loop
    except ImportError as err:
        raise SamebitsError(f"the reference recipe cannot be imported ({err}); pass a command instead.") from None
    return "attach_from_env" in inspect.getsource(loop)


def default_out_dir() -> Path:
    return Path("samebits-out") / time.strftime("bisect-%Y%m%d-%H%M%S")


class _Bisector:
    def __init__(self, side_a: Command, side_b: Command, out: Path, progress, stop_after: int | None,
                 same_command: bool, run_timeout: float | None = None):
        self.run_timeout = run_timeout
        self.side_a, self.side_b = side_a, side_b
        self.out = out
        self.say = progress or (lambda message: None)
        self.stop_after = stop_after
        self.same_command = same_command
        self.stages: list[Stage] = []
        self.notes: list[str] = []
        perturb = os.environ.get("SAMEBITS_TEST_PERTURB", "").strip()
        try:
            self.perturb_b = EventSpec.parse(perturb, "SAMEBITS_TEST_PERTURB") if perturb else None
        except ValueError as err:
            raise SamebitsError(str(err)) from None
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
            seconds = command.launch(directory, run_config,
                                     self.out / "logs" / f"{number}-{stage.name}-{label}.log", self.run_timeout)
            self.notes.extend(command.exit_notes)
            command.exit_notes.clear()
            stage.runs[label] = seconds
            self.say(f"      run {label}: {seconds:.1f} s")
            dirs[label] = directory
        return dirs

    def conclude(self, stage: Stage, report: OriginReport) -> Finding | None:
        stage.verdict = report.verdict
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

    def base_config(self, **changes) -> TraceConfig:
        config = TraceConfig(level=1, stop_after=self.stop_after)
        return config.with_(**changes)

    # -- the stages ---------------------------------------------------------------------------

    def bisect(self) -> BisectResult:
        start = time.perf_counter()
        compared, repeatable = "a vs b", None
        a, b = self.side_a, self.side_b
        if self.same_command:
            stage = Stage("steps", "phases", "all steps, every rank")
            dirs = self.run_stage(stage, self.base_config(), [("a", a), ("b", b)])
            report = find_origins(dirs["a"], dirs["b"])
        else:
            stage = Stage("steps", "phases", "all steps, every rank; each side twice (repeatability)")
            a2 = Command("a2", a.argv, a.recipe)
            b2 = Command("b2", b.argv, b.recipe)
            dirs = self.run_stage(stage, self.base_config(), [("a", a), ("a2", a2), ("b", b), ("b2", b2)])
            noise_a = find_origins(dirs["a"], dirs["a2"])
            noise_b = find_origins(dirs["b"], dirs["b2"])
            repeatable = {"a": noise_a.identical, "b": noise_b.identical}
            self.say("      repeatable: " + ", ".join(f"{side} {'yes' if ok else 'NO'}" for side, ok in repeatable.items()))
            if not noise_a.identical:
                compared, report, b = "a vs a (a is not repeatable: bisecting its run-to-run noise)", noise_a, a2
            elif not noise_b.identical:
                compared, report, a, b = "b vs b (b is not repeatable: bisecting its run-to-run noise)", noise_b, b, b2
            else:
                report = find_origins(dirs["a"], dirs["b"])
            if not (noise_a.identical and noise_b.identical):
                self.notes.append(compared)
        first = self.conclude(stage, report)
        result = BisectResult("identical" if report.identical else "diverged", None, self.stages, str(self.out),
                              compared, repeatable, notes=self.notes)
        if first is None:
            result.seconds = time.perf_counter() - start
            return result
        sides = [("a", a), ("b", b)]
        self._sides = {"a": a, "b": b}
        origin = self._narrow(first, sides, result)
        result.origin = origin
        parted = next((s.finding for s in reversed(self.stages) if s.finding is not None and s.finding.parted), None)
        if result.control_flow is None and parted is not None:
            result.control_flow = _control_flow_json(parted)
        result.seconds = time.perf_counter() - start
        return result

    def _narrow(self, first: Finding, sides, result: BisectResult) -> dict | None:
        step = first.step
        if first.classification == "control_flow":
            result.control_flow = _control_flow_json(first)
            return _origin_json(first, None)
        if first.classification == "order":
            self.notes.append("the runs recorded the same values in a different order; nothing to narrow")
            return _origin_json(first, None)
        if first.classification == "origin" and first.category == "state":
            self.notes.append("the runs differ before their first step: initialisation (or the loaded "
                              "checkpoint) differs, so no training op is the origin")
            return _origin_json(first, None)
        final = first
        subtree = ""
        if not (first.classification == "origin" and first.category == "collective"):
            stage = Stage("modules", "modules", f"step {step} only, then stop")
            dirs = self.run_stage(stage, self.base_config(level=2, step_start=step, step_stop=step + 1,
                                                          stop_after=step), sides)
            found = self.conclude(stage, find_origins(dirs["a"], dirs["b"], step=step))
            if found is None:
                self.notes.append(f"the modules stage did not reproduce the divergence at step {step}: "
                                  "it is intermittent; reporting the steps stage's finding")
                return _origin_json(final, None)
            if found.classification == "control_flow":
                result.control_flow = _control_flow_json(found)
                return _origin_json(found, None)
            final = found
            if found.classification == "origin" and found.category == "collective":
                subtree = None
            else:
                subtree = _subtree_for(found)
            if subtree is not None:
                stage = Stage("ops", "ops", f"step {step}, module {subtree or '(whole model)'}, with call sites")
                config = self.base_config(level=3, step_start=step, step_stop=step + 1, stop_after=step,
                                          module=subtree, call_sites=True)
                dirs = self.run_stage(stage, config, sides)
                found = self.conclude(stage, find_origins(dirs["a"], dirs["b"], step=step))
                if found is not None and found.classification == "control_flow":
                    result.control_flow = _control_flow_json(found)
                    return _origin_json(found, None)
                if found is None:
                    self.notes.append("the ops stage did not reproduce the divergence (intermittent); "
                                      "reporting the modules stage's finding")
                    return _origin_json(final, None)
                if found.classification == "origin" and found.category in ("op", "probe", "collective"):
                    final = found
                else:  # keep the module-level origin; say where the ops first show the difference
                    self.notes.append(f"no ATen op inside {subtree or 'the model'} is an origin; the difference "
                                      f"first shows at {found.where()} ({found.classification}: {found.detail}). "
                                      "It arises below the dispatcher (a kernel or library call) and shows one "
                                      "hop later: put a samebits.trace.probe around that call")
        if final.classification != "origin" or final.category not in ("op", "collective", "probe"):
            return _origin_json(final, None)
        elements = self._dump(final, subtree)
        return _origin_json(final, elements)

    def _dump(self, final: Finding, subtree: str | None) -> dict | None:
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
            dirs = self.run_stage(stage, config, [("a", self.side_for("a")), ("b", self.side_for("b"))])
            for label in ("a", "b"):
                path = dirs[label] / dump_filename(final.rank, step)
                if path.exists():
                    dumps.append((f"{label}{attempt + 1}", path))
            elements = _first_difference(dumps)
            stage.verdict = "diverged" if elements and elements.get("differing") else "identical"
            if elements is None:
                stage.summary = "no dump was written (the event did not run)"
            else:
                stage.summary = (f"{elements['differing']} of {elements['total']} elements differ in output "
                                 f"{elements.get('output')} ({' vs '.join(elements['pair'])}), "
                                 f"max {elements['max_ulp']} ulp")
            self.say(f"      -> {stage.summary}")
            if elements is not None and elements.get("differing"):
                return elements
        self.notes.append("the dump runs did not reproduce a difference at the origin (it is intermittent); "
                          "its element detail is empty")
        return elements

    def side_for(self, label: str) -> Command:
        return self._sides[label]


def _subtree_for(found: Finding) -> str:
    """Where rung 3 looks, given the modules stage's finding."""
    if found.category == "module" and found.module is not None:
        if found.event_id and found.event_id.endswith("@grad"):
            return ""  # a parameter's gradient: the ops using it may sit anywhere
        if found.classification == "origin" and found.phase in ("forward", "recompute"):
            return found.module
        return parent_scope(found.module)  # backward totals, or an input that arrived different
    if found.category == "probe" and found.module is not None:
        return found.module
    return ""


def _first_difference(dumps: list[tuple[str, Path]]) -> dict | None:
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
            elements = compare_elements(out_a, out_b)
            elements["output"], elements["pair"] = label, [label_a, label_b]
            elements["dumps"] = [str(path_a), str(path_b)]
            elements["inputs_identical"] = all(
                name in dump_b["inputs"] and compare_elements(t, dump_b["inputs"][name])["differing"] == 0
                for name, t in dump_a["inputs"].items())
            if chosen is None:
                chosen = elements
            if elements["differing"]:
                return elements
    return chosen


def _origin_json(finding: Finding, elements: dict | None) -> dict:
    """The spec'd ``origin`` object (plus id, category, classification, catalog, detail)."""
    return {
        "step": finding.step, "rank": finding.rank, "phase": finding.phase, "module": finding.module,
        "op": finding.op, "id": finding.event_id, "category": finding.category,
        "classification": finding.classification, "call_site": finding.call_site,
        "elements": elements, "catalog": finding.catalog, "detail": finding.detail,
    }


def _control_flow_json(finding: Finding) -> dict:
    return {"step": finding.step, "rank": finding.rank, "detail": finding.parted or finding.detail}


def bisect(cmd_a: list[str] | None = None, cmd_b: list[str] | None = None, *, out=None,
           steps: int = 4, nproc: int = 2, nondeterministic: bool = False, overrides=(),
           stop_after: int | None = None, run_timeout: float | None = 1800,
           progress: Callable[[str], None] | None = None) -> BisectResult:
    """Find where two runs part, and the op that is the origin.

    * no command: the reference recipe twice (``steps``, ``nproc``, ``nondeterministic``,
      ``overrides`` as in ``samebits verify``);
    * ``cmd_a`` only: that command twice (its run-to-run nondeterminism);
    * ``cmd_a`` and ``cmd_b``: each checked for repeatability, then A against B.

    ``stop_after``: end every run after that step (a long command).  ``run_timeout``: seconds
    one run may take before it is killed (with every process it started) and reported as a
    hang.  Output (streams, logs, dumps) goes under ``out``, which must be new or empty.
    """
    if cmd_b is not None and not cmd_a:
        raise SamebitsError("--b needs --a: give both commands to compare, or one command after --.")
    out = Path(out) if out is not None else default_out_dir()
    if out.exists() and any(out.iterdir()):
        raise SamebitsError(f"{out} exists and is not empty: samebits never overwrites runs. "
                            "Pass a new --out directory or delete the old one.")
    out.mkdir(parents=True, exist_ok=True)
    if not cmd_a:
        side_a, side_b = recipe_commands(steps=steps, nproc=nproc, nondeterministic=nondeterministic,
                                         overrides=overrides)
        same = True
    else:
        side_a = Command("a", list(cmd_a))
        same = cmd_b is None
        side_b = Command("b", list(cmd_a if cmd_b is None else cmd_b))
    bisector = _Bisector(side_a, side_b, out, progress, stop_after, same, run_timeout)
    result = bisector.bisect()
    _write_summary(out, result)
    return result


def _write_summary(out: Path, result: BisectResult) -> None:
    import json

    (out / "summary.json").write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
