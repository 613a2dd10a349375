"""The phase table (samebits.stream.phases) and `Recorder.optimizer_step`, the one writer of
the after-optimizer-step records (zero-code recording, the integrations and the recipe call it)."""

from __future__ import annotations

import subprocess
import sys

import torch

import samebits
from samebits.stream import phases


def _records(directory):
    return [(b.step, r.phase, r.name, r.absent, r.digest)
            for b in samebits.open_run(directory).stream(0).steps() for r in b.records()]


def test_optimizer_step_writes_what_the_calls_it_replaces_wrote(tmp_path):
    """Gradients, parameters, optimizer state in that order; an absent gradient; a phase given
    whole records; a second optimizer's prefix; a phase left out (None).  Fails before
    `optimizer_step` existed, and on any change of order, phase name or record kind."""
    grads = [("w", torch.ones(3)), ("b", None)]
    params = [("w", torch.arange(3.0)), ("b", torch.zeros(2, dtype=torch.bfloat16))]
    state = [("w.exp_avg", torch.full((3,), 0.5))]
    with samebits.Recorder(tmp_path / "one", rank=0, world_size=1) as rec:
        rec.optimizer_step(0, grads=grads, params=params, optimizer=state, whole=("params",))
        rec.optimizer_step(0, grads=None, params=params, optimizer=state, number=1)
    with samebits.Recorder(tmp_path / "two", rank=0, world_size=1) as rec:
        rec.tensors(0, "grads", grads)
        rec.tensors(0, "params", params)
        rec.global_tensors(0, "params", params)
        rec.tensors(0, "optimizer", state)
        rec.tensors(0, "optimizer1.params", params)
        rec.tensors(0, "optimizer1.optimizer", state)
    one = _records(tmp_path / "one")
    assert one == _records(tmp_path / "two")
    assert [phase for _, phase, *_ in one] == ["grads"] * 2 + ["params"] * 2 + ["global:params"] * 2 + [
        "optimizer", "optimizer1.params", "optimizer1.params", "optimizer1.optimizer"]


def test_the_table_orders_and_groups_as_its_readers_did():
    """The origin ordering and the report's groups, as trace/_origin.py and runs/report.py
    spelled them before the table (issue 36): a changed entry reorders findings or renames a group."""
    order = {p: phases.training_rank(p) for p in ("data", "forward", "metrics", "grads", "params", "optimizer",
                                                   "backward", "loss", "state", "made-up")}
    index = phases.TRAINING_PHASES.index
    assert order == {"data": index("forward"), "forward": index("forward"), "metrics": index("reduce"),
                     "grads": index("reduce"), "params": index("optimizer"), "optimizer": index("optimizer"),
                     "backward": 8, "loss": 8, "state": 8, "made-up": 8}
    assert [phases.report_group(p) for p in ("params", "grads", "optimizer", "forward", "data", "backward")] == [
        "params", "grads", "optimizer state", "activations", "inputs", "backward"]
    assert set(phases.REPORT_GROUPS) == {p.group for p in phases.PHASES.values() if p.group}
    assert {p.name for p in phases.PHASES.values() if p.state} == {
        "state", "state_end", "inputs", "restored.params", "restored.optimizer"}
    assert samebits.stream.GLOBAL_PHASE_PREFIX == phases.GLOBAL_PHASE_PREFIX
    for phase, number in (("params", None), ("grads", 2), ("optimizer", 10)):  # what optimizer_step writes, read back
        assert phases.split_optimizer_phase(phases.optimizer_phase(phase, number)) == (
            phase, None if number is None else str(number))
    assert phases.split_optimizer_phase("restored.params") == ("restored.params", None)


def test_the_table_loads_no_torch():
    """The CLI and the report read the table; importing it must not import torch."""
    code = "import sys, samebits.stream.phases; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
