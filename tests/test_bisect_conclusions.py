"""`samebits bisect`'s final conclusion step, with the runs and comparisons scripted (fast, no
subprocess): a conclusion may never contradict an earlier stage's evidence, a resume's state
census is read past the generators that differ in every run, and "inputs matched" is never
said when the dumps show the inputs differ."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from samebits.runners._bisect_narrow import Side, _Bisector
from samebits.runners.bisect import Elements, bisect
from samebits.runners.program import ZeroCode
from samebits.trace import OriginFinding, OriginReport
from samebits.verdicts import Verdict

bisect_module = importlib.import_module("samebits.runners._bisect_narrow")  # where bisect narrows
OPTIMIZER_ORIGIN = dict(classification="origin", category="phase", phase="optimizer", event_id="optimizer:0",
                        role="out", label="w", detail="all inputs of optimizer:0 matched; its output w differs")
LEFTOVERS = dict(classification="control_flow", category="op", phase="forward", module="",
                 op="aten::_local_scalar_dense", event_id="/aten::_local_scalar_dense:0", role="in", label="0",
                 detail="the recorded sequences part at record #0 of step 2: a has op "
                        "/aten::_local_scalar_dense:0 (forward, in 0), b has op /aten::randint:0 (forward, out 0)")


def scripted(monkeypatch, findings: dict[str, dict | None], step: int = 2):
    """Replace running and comparing: stage ``name``'s a-vs-b comparison finds ``findings[name]``
    (OriginFinding fields, at ``step`` on rank 0); a side against its own repeat is identical."""
    def run_stage(self, stage, config, sides):
        number = len(self.stages) + 1
        self.stages.append(stage)
        return {label: self.out / f"{number}-{stage.name}" / label for label, _ in sides}

    def find_origins(a, b, **_):
        a, b = Path(a), Path(b)
        fields = None if b.name in ("a2", "b2") else findings.get(a.parent.name.partition("-")[2])
        found = {} if fields is None else {0: OriginFinding(0, step, **fields)}
        origins = [f for f in found.values() if f.classification == "origin"]
        return OriginReport(str(a), str(b), Verdict.DIVERGED if found else Verdict.IDENTICAL,
                            step if found else None, found, origins)

    monkeypatch.setattr(_Bisector, "run_stage", run_stage)
    monkeypatch.setattr(bisect_module, "find_origins", find_origins)
    monkeypatch.setattr(bisect_module, "_check_compared", lambda dirs: None)
    monkeypatch.setattr(bisect_module, "find_replica_mismatch", lambda run: None)


def run_bisect(tmp_path, offset=None):
    return bisect(["python", "a.py"], ["python", "b.py"], out=tmp_path / "o", b_step_offset=offset)


def test_a_planted_contradiction_becomes_not_localised(tmp_path, monkeypatch):
    """Stages 1-2: "phase optimizer: inputs matched, output differs"; the ops stage: different
    ops at the step's first record (a resume's leftovers).  Concluding control_flow there would
    contradict stages 1-2: the conclusion is not_localised, saying what they found."""
    scripted(monkeypatch, {"steps": OPTIMIZER_ORIGIN, "modules": OPTIMIZER_ORIGIN, "ops": LEFTOVERS})
    result = run_bisect(tmp_path)
    origin = result.origin
    assert origin.kind == "not_localised", result.conclusion
    assert (origin.phase, origin.step) == ("optimizer", 2)
    assert "stage 1 (steps" in result.conclusion and "phase optimizer" in result.conclusion
    assert "Ruled out" in result.conclusion and "control_flow" in result.conclusion
    assert any("cannot explain it" in note for note in result.notes)


def test_an_op_origin_in_another_phase_is_no_conclusion_about_this_one(tmp_path, monkeypatch):
    """An op whose inputs matched and whose output differs, but in the forward, while stage 1
    found the forward, backward and reduce phases equal and the optimizer's output differing."""
    forward_op = dict(classification="origin", category="op", phase="forward", module="", op="aten::mul",
                      event_id="/aten::mul:3", role="out", label="0",
                      detail="all inputs of /aten::mul:3 matched; its output 0 differs")
    scripted(monkeypatch, {"steps": OPTIMIZER_ORIGIN, "modules": OPTIMIZER_ORIGIN, "ops": forward_op})
    result = run_bisect(tmp_path)
    assert result.origin.kind == "not_localised" and result.origin.phase == "optimizer", result.conclusion
    assert "all inputs of /aten::mul:3 matched" not in result.conclusion.partition("(")[0]


def test_a_conclusion_about_the_same_phase_stands(tmp_path, monkeypatch):
    """Different ops inside the optimizer phase that stage 1 pointed at: consistent, kept."""
    in_optimizer = dict(LEFTOVERS, phase="optimizer", op="aten::mul_", event_id="/aten::mul_:0",
                        detail="the recorded sequences part at record #700 of step 2")
    scripted(monkeypatch, {"steps": OPTIMIZER_ORIGIN, "modules": OPTIMIZER_ORIGIN, "ops": in_optimizer})
    result = run_bisect(tmp_path)
    assert result.origin.kind == "control_flow" and result.origin.phase == "optimizer", result.conclusion


def test_a_resumed_optimizer_that_runs_other_ops_lost_its_state(tmp_path, monkeypatch):
    """In a resume bisect, the same gradients and parameters (stage 1) and other ops inside
    the optimizer step (rung 3, aligned on the phases): its state was not restored."""
    in_optimizer = dict(LEFTOVERS, phase="optimizer", op="aten::mul_", event_id="/aten::mul_:0",
                        detail="the recorded sequences part at record #700 of step 2")
    scripted(monkeypatch, {"steps": OPTIMIZER_ORIGIN, "modules": OPTIMIZER_ORIGIN, "ops": in_optimizer})
    result = run_bisect(tmp_path, offset=2)
    assert result.origin.kind == "resume_state" and result.origin.phase == "optimizer", result.conclusion
    assert "optimizer's own state" in result.conclusion and "stage 1" in result.conclusion


def test_resume_state_reads_past_generators_that_differ_in_every_run(tmp_path, monkeypatch):
    """Python's and NumPy's generators are unseeded in most scripts: they differ between any two
    processes and must not hide the optimizer step counts a resume forgot."""
    scripted(monkeypatch, {"steps": dict(OPTIMIZER_ORIGIN, state_differs=["rng.python", "rng.numpy",
                                                                           "optim0.step"])})
    result = run_bisect(tmp_path, offset=2)
    assert result.origin.kind == "resume_state", result.conclusion
    assert result.origin.state_differs == ["optim0.step"]
    assert "optimizer 0 step counts differ" in result.conclusion and "Python" not in result.conclusion
    assert [stage.name for stage in result.stages] == ["steps"]


def _elements(inputs_differ, permuted):
    detail = {"differing": 1, "total": 1, "max_ulp": 3, "values": [], "dtype": "float32", "shape": [],
              "first_indices": []}
    return Elements(detail, "0", ["a1", "b1"], ["x", "y"], same_values=False, inputs_identical=not inputs_differ,
                    inputs_differ=inputs_differ, inputs_permuted=permuted)


@pytest.mark.parametrize("differ, permuted, kind", [([], False, "op"), (["0.0", "0.3"], True, "order"),
                                                    (["1"], False, "not_localised")])
def test_inputs_matched_is_said_only_when_the_dumps_agree(tmp_path, differ, permuted, kind):
    """The trace saw every input recorded before the op match; its dumps compare them in
    value and position.  Inputs that hold each other's values: order; others: not the origin."""
    bisector = _Bisector(Side("a", ZeroCode(("x",))), Side("b", ZeroCode(("y",))), tmp_path, None, None, False)
    final = OriginFinding(0, 1, "origin", category="op", phase="reduce", module="", op="aten::_foreach_norm",
                          event_id="/aten::_foreach_norm:0", role="out", label="0", call_site="train.py:9 in <module>",
                          detail="all inputs of /aten::_foreach_norm:0 matched; its output 0 differs")
    origin = bisector._explain_origin(final, _elements(differ, permuted))
    assert origin.kind == kind, origin.conclusion
    assert ("all inputs" in origin.conclusion) == (kind == "op")
    if kind == "order":
        assert origin.conclusion.startswith("same values, different order") and "train.py:9" in origin.conclusion


def test_dumps_tell_permuted_inputs_from_other_ones(tmp_path):
    a, b = torch.arange(3.0), torch.ones(2)
    base = {"step": 1, "rank": 0, "outputs": {"0": torch.tensor(1.0)}}
    for name, inputs, out in (("a", {"0.0": a, "0.1": b}, 1.0), ("b", {"0.0": b, "0.1": a}, 2.0),
                              ("c", {"0.0": a, "0.1": b * 2}, 3.0)):
        torch.save(dict(base, inputs=inputs, outputs={"0": torch.tensor(out)}), tmp_path / f"{name}.pt")
    permuted = bisect_module._first_difference([("a1", tmp_path / "a.pt"), ("b1", tmp_path / "b.pt")])
    assert (permuted.inputs_identical, permuted.inputs_permuted, permuted.inputs_differ) == \
        (False, True, ["0.0", "0.1"])
    other = bisect_module._first_difference([("a1", tmp_path / "a.pt"), ("b1", tmp_path / "c.pt")])
    assert (other.inputs_identical, other.inputs_permuted, other.inputs_differ) == (False, False, ["0.1"])
