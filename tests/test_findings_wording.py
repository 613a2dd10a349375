"""Findings name the state that differs at the step it differs, whose order differs, when a
dump did not reproduce the difference, and never a component the program does not have; an
exit-2 error keeps the verdicts the runs before it gave (issue 35, items 6 and 7).

The fast tests script the comparison (bisect's conclusion step, compare's counts, verify's
error context) or read small streams written here; the slow ones run the user-like scripts of
tests/scripts_resume and tests/scripts_bisect under `samebits verify` / `samebits bisect`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import samebits
from samebits.compare import diff
from samebits.checkpoint import describe_state_record
from samebits.runners._explain import explain_resume, ordered
from samebits.runners._launch import RunFailed
from samebits.runners._bisect_narrow import Side, _Bisector, _Evidence
from samebits.runners.bisect import Elements, bisect
from samebits.runners.program import ZeroCode
from samebits.runners.verify import RunInfo, _curves_cut, _keeping_earlier_verdicts
from samebits.trace import OriginFinding, OriginReport
from samebits.verdicts import Verdict

bisect_module = importlib.import_module("samebits.runners._bisect_narrow")  # where bisect narrows
RESUME = Path(__file__).parent / "scripts_resume"
BISECT = Path(__file__).parent / "scripts_bisect"
MINIGPT = RESUME / "minigpt.py"


def _verify(out: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "samebits", "verify", "--json", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout)


# -- the words of a census record: a scheduler's position, an LR without a scheduler ------------


def test_a_scheduler_record_names_the_scheduler_field_never_the_learning_rate():
    said = describe_state_record("sched0.last_epoch", {"optim0.lr", "sched0.last_epoch"})
    assert "LR scheduler 0's position (last_epoch" in said and "scheduler.load_state_dict" in said
    assert "learning rate" not in said


@pytest.mark.parametrize("present", [{"rng.python", "optim0.step", "optim0.lr"}, None])
def test_a_learning_rate_is_never_blamed_on_a_scheduler_the_program_lacks(present):
    said = describe_state_record("optim0.lr", present)
    assert "LR scheduler not restored" not in said
    assert "iteration counter" in said
    if present is not None:
        assert "the program has no LR scheduler" in said


def _scripted_steps_stage(monkeypatch, finding: dict) -> None:
    """Bisect's runs and comparisons replaced: its steps stage finds ``finding`` (OriginFinding
    fields) at step 2 on rank 0, each side against its own repeat is identical (as in
    test_bisect_conclusions)."""
    def run_stage(self, stage, config, sides):
        number = len(self.stages) + 1
        self.stages.append(stage)
        return {label: self.out / f"{number}-{stage.name}" / label for label, _ in sides}

    def find_origins(a, b, **_):
        found = {} if Path(b).name in ("a2", "b2") else {0: OriginFinding(0, 2, **finding)}
        return OriginReport(str(a), str(b), Verdict.DIVERGED if found else Verdict.IDENTICAL, 2 if found else None,
                            found, list(found.values()))

    monkeypatch.setattr(_Bisector, "run_stage", run_stage)
    monkeypatch.setattr(bisect_module, "find_origins", find_origins)
    monkeypatch.setattr(bisect_module, "_check_compared", lambda dirs: None)
    monkeypatch.setattr(bisect_module, "find_replica_mismatch", lambda run: None)


def test_bisect_resume_state_without_a_scheduler_blames_the_iteration_counter(tmp_path, monkeypatch):
    """A resume bisect whose step starts with another LR in a program with no LR scheduler
    (its census holds no sched* record): the old conclusion led with "LR scheduler not restored"."""
    _scripted_steps_stage(monkeypatch, dict(classification="origin", category="phase", phase="optimizer",
                                            event_id="optimizer:0", role="out", label="w",
                                            detail="all inputs of optimizer:0 matched; its output w differs",
                                            state_differs=["optim0.lr"]))
    names = {"rng.python", "rng.torch_cpu", "optim0.step", "optim0.lr", "optim0.hparams"}  # no sched*
    monkeypatch.setattr(bisect_module, "census_names", lambda directory, rank, step: names, raising=False)
    result = bisect(["python", "a.py"], ["python", "b.py"], out=tmp_path / "o", b_step_offset=2)
    assert result.origin.kind == "resume_state", result.conclusion
    assert "LR scheduler not restored" not in result.conclusion
    assert "the program has no LR scheduler" in result.conclusion and "iteration counter" in result.conclusion


def _census_run(root: Path, name: str, steps: range, scheduler: bool) -> Path:
    """A run with a main stream and a census (RUN/state) of one optimizer and, with
    ``scheduler``, one LR scheduler, as zero-code recording names them."""
    main = samebits.Recorder(root / name, config={"lr": 0.1})
    census = samebits.Recorder(root / name / "state", config={"lr": 0.1})
    for step in steps:
        main.tensors(step, "params", [("w", torch.full((2,), float(step)))])
        main.end_step(step)
        records = [("optim0.step", torch.tensor([float(step)])), ("optim0.lr", torch.tensor([0.1], dtype=torch.float64))]
        if scheduler:
            records += [("sched0.last_epoch", torch.tensor([step])), ("sched0.step_count", torch.tensor([step + 1])),
                        ("sched0.lr", torch.tensor([0.1], dtype=torch.float64))]
        census.tensors(step, "state", records)
        census.end_step(step)
    main.close()
    census.close()
    return root / name


def test_a_scheduler_the_resumed_run_lacks_is_one_finding_about_the_scheduler(tmp_path):
    """C never made A's LR scheduler: one finding (not one per scheduler record), which says the
    scheduler is missing and does not claim the learning rate differs (it is equal here)."""
    a = _census_run(tmp_path, "a", range(3), scheduler=True)
    c = _census_run(tmp_path, "c", range(1, 3), scheduler=False)
    findings = ordered(explain_resume(a, None, c, 1, 1))
    assert [(f.kind, f.step, f.record) for f in findings] == [("scheduler", 1, "sched0.last_epoch")], findings
    assert "C has no LR scheduler 0" in findings[0].says and "learning rate" not in findings[0].says


# -- dumps that do not reproduce the difference# -- dumps that do not reproduce the difference ---------------------------------------------------


def test_an_origin_whose_dumps_do_not_differ_says_the_difference_did_not_recur(tmp_path, monkeypatch):
    """The trace found an op whose inputs matched and whose output differs; its dump runs (a race
    that did not fire again) hold equal outputs.  The old origin showed them as its element detail
    ("0 of 4160 differ, max 0 ulp")."""
    detail = {"differing": 0, "total": 4160, "max_ulp": 0, "values": [], "dtype": "float32", "shape": [65, 64],
              "first_indices": []}
    equal = Elements(detail, "0", ["a1", "b1"], ["x", "y"], same_values=False, inputs_identical=True)
    monkeypatch.setattr(_Bisector, "_dump", lambda self, final, subtree: equal)
    bisector = _Bisector(Side("a", ZeroCode(("x",))), Side("b", ZeroCode(("x",))), tmp_path, None, None, True)
    final = OriginFinding(0, 1, "origin", category="op", phase="backward", module="", op="aten::index_put_",
                          event_id="/aten::index_put_:0", role="out", label="0", call_site="train.py:9 in <module>",
                          detail="all inputs of /aten::index_put_:0 matched; its output 0 differs")
    origin = bisector._finish(final, "", _Evidence())
    assert origin.kind == "op"
    assert origin.elements is None, "equal dumps are no element detail of the difference"
    assert "did not reproduce the difference" in origin.conclusion and "did not recur" in origin.conclusion
    assert "4160 elements" in origin.conclusion


# -- compare's counts: a step that diverges was compared ---------------------------------------


def test_a_divergence_at_the_first_record_counts_the_records_compared(tmp_path):
    """B differs from A in the first record of its first step (the live check stops it there):
    the old count read "1 x 1 x 0" records, a divergence found in nothing."""
    for name, bump in (("a", 0.0), ("b", 1.0)):
        rec = samebits.Recorder(tmp_path / name, config={"lr": 0.1})
        rec.tensors(0, "params", [("w", torch.ones(3) + bump), ("v", torch.zeros(2))])
        rec.end_step(0)
        rec.close()
    result = diff(tmp_path / "a", tmp_path / "b")
    assert result.first_divergence.step == 0 and result.first_divergence.name == "w"
    assert (result.compared["steps"], result.compared["records"]) == (1, 2), result.compared


# -- an exit-2 error keeps the verdicts before it ------------------------------------------------


def _two_runs(root: Path, differ: bool) -> None:
    for name in ("a", "b"):
        rec = samebits.Recorder(root / name, config={"lr": 0.1})
        for step in range(2):
            value = torch.full((3,), float(step)) + (1.0 if differ and name == "b" and step == 1 else 0.0)
            rec.tensors(step, "params", [("w", value)])
            rec.end_step(step)
        rec.close()


@pytest.mark.parametrize("differ", [True, False])
def test_a_failed_run_keeps_the_independent_runs_verdict(tmp_path, differ):
    _two_runs(tmp_path, differ)
    runs = [RunInfo("A", "python t.py", 0, 1.0),
            RunInfo("B", "python t.py", 3 if differ else 0, 1.0,
                    "stopped at step 1 (differs from A)" if differ else "finished")]
    with pytest.raises(RunFailed) as raised:
        with _keeping_earlier_verdicts(tmp_path, runs):
            raise RunFailed("run C (resume) failed (python t.py --resume): KeyError: 'optim'", "KeyError", "C (resume)")
    message = str(raised.value)
    assert message.startswith("run C (resume) failed (its error below); before it, the independent runs A and B")
    assert "KeyError: 'optim'" in message and raised.value.label == "C (resume)"
    if differ:
        assert "diverged at step 1, rank 0 (params/w)" in message and "guarantee 1 fails" in message
    else:
        assert "were identical" in message and "guarantee 1 held" in message


def test_a_failed_first_run_has_no_earlier_verdict(tmp_path):
    with pytest.raises(RunFailed) as raised:
        with _keeping_earlier_verdicts(tmp_path, [RunInfo("A", "python t.py", 0, 1.0)]):
            raise RunFailed("run B failed: boom", "boom", "B")
    assert str(raised.value) == "run B failed: boom"


def test_a_bisect_whose_later_run_fails_keeps_what_its_stages_found(tmp_path, monkeypatch):
    """The steps stage located the first divergence (an op in the forward of step 2); a run of
    the modules stage then crashes.  The old exit-2 message showed only that run's error."""
    forward = dict(classification="origin", category="phase", phase="forward", event_id="forward/model:0",
                   role="out", label="0", detail="all inputs of forward/model:0 matched; its output 0 differs")
    _scripted_steps_stage(monkeypatch, forward)
    scripted_run_stage = _Bisector.run_stage

    def run_stage(self, stage, config, sides):
        if stage.name != "steps":
            self.stages.append(stage)
            raise RunFailed("run a failed (python a.py): MemoryError", "MemoryError", "a")
        return scripted_run_stage(self, stage, config, sides)

    monkeypatch.setattr(_Bisector, "run_stage", run_stage)
    with pytest.raises(RunFailed) as raised:
        bisect(["python", "a.py"], ["python", "b.py"], out=tmp_path / "o")
    message = str(raised.value)
    assert message.startswith("bisect stopped in stage 2 (modules) (its error below); the stages before it found:")
    assert "stage 1 (steps" in message and "origin: rank 0, step 2, phase forward" in message
    assert "all inputs of forward/model:0 matched" in message
    assert message.endswith("run a failed (python a.py): MemoryError") and raised.value.label == "a"


# -- verify says when the live check cut the curves --------------------------------------------


def test_runs_stopped_by_the_live_check_suggest_keep_going():
    runs = [RunInfo("A", "x", 0, 1.0), RunInfo("B", "x", 0, 1.0),
            RunInfo("C (resume)", "x", 3, 1.0, "stopped at step 4 (differs from A)")]
    (note,) = _curves_cut(runs)
    assert "stopped C at step 4" in note and "--keep-going" in note
    assert _curves_cut(runs[:2]) == []


# -- the user-like scripts, end to end ------------------------------------------------------------


@pytest.mark.slow
def test_verify_names_the_scheduler_position_at_the_resume_step_and_the_lr_at_its_own(tmp_path):
    """tests/scripts_resume/minigpt.py --sched, resumed without its LambdaLR: at the resume step
    (3) the LR is A's (the optimizer's state restored it) and the scheduler's last_epoch is A's
    of step 0; the LR differs from step 4.  The old finding said "learning rate differs at step
    start" at step 3."""
    proc = _verify(tmp_path / "v", "--resume-at", "3", "--resume-with",
                   f"{sys.executable} {MINIGPT} --out {{out}} --resume-from {{from}} --sched --bug sched",
                   "--", sys.executable, str(MINIGPT), "--out", "{out}", "--sched")
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    first = result["findings"][0]
    assert (first["kind"], first["step"], first["record"]) == ("scheduler", 3, "sched0.last_epoch"), first
    assert "learning rate differs at step start" not in first["says"]
    assert "last_epoch" in first["says"] and "C's is A's at step 0" in first["says"]
    assert "still A's at step 3" in first["says"] and "differs from step 4 on" in first["says"]
    assert any("--keep-going" in note for note in result["notes"])  # C was stopped at step 4


@pytest.mark.slow
def test_verify_and_bisect_never_name_a_scheduler_a_program_does_not_have(tmp_path):
    """minigpt.py has no LR scheduler and computes its LR from iter_num; resumed without
    iter_num.  The old verify said "no LR scheduler state differs", the old bisect led with
    "LR scheduler not restored"."""
    resume = f"{sys.executable} {MINIGPT} --out {{out}} --resume-from {{from}} --bug iter"
    proc = _verify(tmp_path / "v", "--resume-at", "3", "--resume-with", resume,
                   "--", sys.executable, str(MINIGPT), "--out", "{out}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    first = json.loads(proc.stdout)["findings"][0]
    assert first["kind"] == "iteration_counter" and "the program has no LR scheduler" in first["says"], first
    assert "no LR scheduler state differs" not in first["says"]
    proc = subprocess.run([sys.executable, "-m", "samebits", "bisect", "--json", "--out", str(tmp_path / "b"),
                           "--a", f"{sys.executable} {MINIGPT} --out {{out}}", "--b", resume, "--b-step-offset", "3"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stderr[-3000:]
    conclusion = json.loads(proc.stdout)["conclusion"]
    assert "LR scheduler not restored" not in conclusion
    assert "the program has no LR scheduler" in conclusion and "iteration counter" in conclusion


@pytest.mark.slow
def test_verify_says_a_reordered_step_is_the_optimizers_parameter_order(tmp_path):
    """tests/scripts_bisect/set_param_groups.py builds its param groups from sets: A and B hold
    the same values in another order (each process its own PYTHONHASHSEED; the two may draw the
    same order, so up to three pairs are run).  The old finding said "the same records in
    another order" without whose order it is."""
    for attempt in range(3):
        proc = _verify(tmp_path / f"v{attempt}", "--", sys.executable, str(BISECT / "set_param_groups.py"))
        if proc.returncode == 1:
            break
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    first = result["findings"][0]
    assert first["kind"] == "order" and "the optimizer's parameter order" in first["says"], first
    assert "a Python set" in first["says"] and not first["says"].startswith("step 0, rank 0")
    compared = result["checks"]["independent"]["compared"]
    assert compared["records"] > 0, compared  # not "1 x 1 x 0"


@pytest.mark.slow
def test_a_resume_that_crashes_after_b_diverged_keeps_bs_finding(tmp_path):
    """tests/scripts_resume/unseeded_crash.py: B differs from A at step 0 (unseeded initial
    weights: the root cause) and C crashes on a checkpoint key.  The old exit-2 message showed
    only C's KeyError."""
    script = RESUME / "unseeded_crash.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--out", str(tmp_path / "v"),
                           "--resume-at", "2", "--resume-with",
                           f"{sys.executable} {script} --out {{out}} --resume-from {{from}}",
                           "--", sys.executable, str(script), "--out", "{out}"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = proc.stderr[proc.stderr.index("samebits verify: error:"):]
    assert "run C (resume) failed (its error below); before it, the independent runs A and B diverged at step 0" \
        in error
    assert "the initial parameters differ before step 0" in error
    assert "KeyError: 'optim'" in error
