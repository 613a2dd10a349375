"""verify's findings rest on what the census shows (issue 33).

tests/scripts_resume/steps_and_batches.py saves model, optimizer and step but no random state
(as torchtitan does), and logs rows it picks from the global torch generator after every other
optimizer step: a resumed run C's torch generator is in another state than A's at the resume
step, and no training step draws from it.  The old findings blamed that generator ("the step
draws from it") for every resume bug of this script; here each bug is named for what it is.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from samebits.compare import diff
from samebits.runners._explain import explain_independent, explain_resume, ordered

pytestmark = pytest.mark.slow  # six zero-code runs

SCRIPT = Path(__file__).parent / "scripts_resume" / "steps_and_batches.py"
RESUME_AT = 3
STEPS = 6


def _record(out: Path, *script_args: str, reference: Path | None = None, step_offset: int | None = None) -> Path:
    argv = [sys.executable, "-m", "samebits", "run", "--out", str(out)]
    if reference is not None:
        argv += ["--reference", str(reference)]
    if step_offset is not None:
        argv += ["--step-offset", str(step_offset)]
    argv += ["--", sys.executable, str(SCRIPT), "--out", str(out.with_name(out.name + "-work")),
             "--steps", str(STEPS), *script_args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    stopped = "STOPPED at step" in proc.stderr  # the live check stopped it at its first divergent step
    assert proc.returncode == 0 or (stopped and proc.returncode == 3), proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("evidence")
    a = _record(root / "a")
    return {"root": root, "a": a, "b": _record(root / "b", reference=a)}


def _resumed(runs, bug: str):
    a = runs["a"]
    c = _record(runs["root"] / f"c-{bug}", "--resume", str(a.with_name("a-work") / f"step-{RESUME_AT}.pt"),
                "--bug", bug, reference=a, step_offset=RESUME_AT)
    result = diff(a, c, start_step=RESUME_AT)
    assert not result.identical, f"the {bug} resume should differ from A"
    return result, ordered(explain_resume(a, runs["b"], c, RESUME_AT, result.first_divergence.step))


def test_a_step_counter_not_restored_is_named_and_no_idle_generator_is(runs):
    result, findings = _resumed(runs, "counter")
    # C trains the same steps as A from the resume (same batches, LR, state), then past A's end.
    assert result.first_divergence.step == STEPS
    assert [f.kind for f in findings] == ["iteration_counter"], findings  # before: a torch RNG "drawn in the step"
    (finding,) = findings
    assert finding.step == STEPS and "C trains past A's end" in finding.says
    assert f"A's last step is {STEPS - 1}" in finding.says and f"to step {RESUME_AT + STEPS - 1}" in finding.says


def test_a_replayed_batch_is_the_data_position_with_the_step_it_replays(runs):
    result, findings = _resumed(runs, "replay")
    assert result.first_divergence.step == RESUME_AT
    first = findings[0]
    assert first.kind == "data_position" and first.step == RESUME_AT, findings
    assert "C's batch is A's batch of step 0" in first.says and "data position was not restored" in first.says
    assert not any(f.kind == "generator" for f in findings), findings  # the torch generator moved in no step


def test_unseeded_initial_weights_are_the_initial_parameters(runs):
    root = runs["root"]
    a = _record(root / "unseeded-a", "--bug", "unseeded")
    b = _record(root / "unseeded-b", "--bug", "unseeded")
    result = diff(a, b, allow_config_diff=True)  # the commands differ in their work folders, outside the runs
    assert result.first_divergence.step == 0
    findings = ordered(explain_independent(a, b, 0))
    assert findings and findings[0].kind == "initial_params", findings  # before: a generator "drawn in the step"
    assert "initial parameters differ before step 0" in findings[0].says
    assert not any(f.kind == "generator" for f in findings), findings  # no step draws from it
