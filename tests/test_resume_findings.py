"""verify names the missing state of the common resume bugs of a real trainer's shape.

tests/scripts_resume/minigpt.py is a nanoGPT-shaped trainer (prefetching get_batch on the
global generator, LR from iter_num, weight-decay groups, loss.item() after the step) with the
common resume bugs behind --bug.  Each case records A (which checkpoints at step 3), resumes C
from it with one bug under zero-code recording, and checks the first finding: its kind, step
and what it says.  Every case fails on the old census (optimizers known only after their
first step, no inputs, no restored parameters, every differing generator a suspect).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from samebits.compare import diff
from samebits.runners._explain import census_suspects, explain_independent, explain_resume, ordered

SCRIPT = Path(__file__).parent / "scripts_resume" / "minigpt.py"
CKPT_AT = 3



def _record(out: Path, *script_args: str, reference: Path | None = None, step_offset: int | None = None) -> Path:
    argv = [sys.executable, "-m", "samebits", "run", "--out", str(out)]
    if reference is not None:
        argv += ["--reference", str(reference)]
    if step_offset is not None:
        argv += ["--step-offset", str(step_offset)]
    argv += ["--", sys.executable, str(SCRIPT), "--out", str(out / "work"), *script_args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    stopped = "STOPPED at step" in proc.stderr  # the live check stopped it at its first divergent step
    assert proc.returncode == 0 or (stopped and proc.returncode == 3), proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A (saves at step 3) and B for three script shapes; C variants are made per test."""
    root = tmp_path_factory.mktemp("resume-findings")
    made = {}
    for shape, extra in (("plain", ()), ("sched", ("--sched",)), ("loader", ("--loader",))):
        made[shape] = _record(root / f"{shape}-a", *extra)
    made["plain-b"] = _record(root / "plain-b", reference=made["plain"])
    made["root"] = root
    return made


def _resume_findings(runs, shape: str, bug: str, *, step_offset: int = CKPT_AT, extra=()):
    a = runs[shape]
    c = _record(runs["root"] / f"{shape}-c-{bug}-{step_offset}", "--resume-from", str(a / "work"), "--bug", bug,
                *extra, reference=a, step_offset=step_offset)
    result = diff(a, c, start_step=step_offset, allow_config_diff=True)
    assert not result.identical, f"the {bug} resume should differ from A"
    b = runs["plain-b"] if shape == "plain" else None
    findings = ordered(explain_resume(a, b, c, step_offset, result.first_divergence.step))
    assert findings, f"no finding for the {bug} resume"
    for finding in findings:  # the script never draws from Python's or NumPy's generators
        assert finding.generator not in ("python", "numpy"), finding
    return findings


@pytest.mark.slow
def test_a_correct_resume_is_identical(runs):
    a = runs["plain"]
    c = _record(runs["root"] / "plain-c-ok", "--resume-from", str(a / "work"), reference=a, step_offset=CKPT_AT)
    assert diff(a, c, start_step=CKPT_AT, allow_config_diff=True).identical


@pytest.mark.slow
def test_optimizer_state_not_restored_is_named(runs):
    first = _resume_findings(runs, "plain", "optim")[0]
    assert (first.kind, first.step) == ("optimizer_state", CKPT_AT)
    assert "holds no state" in first.says and "load_state_dict" in first.says


@pytest.mark.slow
def test_iteration_counter_not_restored_is_named_with_its_evidence(runs):
    first = _resume_findings(runs, "plain", "iter")[0]
    assert (first.kind, first.record) == ("iteration_counter", "optim0.lr")
    assert "A's at step 0" in first.says  # the LR schedule restarted


@pytest.mark.slow
def test_a_stray_reinit_after_the_load_is_named(runs):
    first = _resume_findings(runs, "plain", "reinit")[0]
    assert first.kind == "model_params" and "fc.weight" in first.says


@pytest.mark.slow
def test_a_prefetched_batch_drawn_again_is_named(runs):
    first = _resume_findings(runs, "plain", "prefetch")[0]
    assert first.kind == "data_position" and f"A's batch of step {CKPT_AT + 1}" in first.says


@pytest.mark.slow
def test_a_resume_off_by_one_is_named(runs):
    first = _resume_findings(runs, "plain", "none", step_offset=CKPT_AT + 1)[0]
    assert first.kind == "off_by_one" and f"A's at step {CKPT_AT}" in first.says


@pytest.mark.slow
def test_a_scheduler_not_restored_is_named(runs):
    first = _resume_findings(runs, "sched", "sched", extra=("--sched",))[0]
    assert first.kind == "scheduler" and first.record.startswith("sched0.")


@pytest.mark.slow
def test_a_loader_that_does_not_skip_is_named(runs):
    first = _resume_findings(runs, "loader", "noskip", extra=("--loader",))[0]
    assert first.kind == "data_position" and first.record.startswith("data.minigpt.py:")


@pytest.mark.slow
def test_a_generator_restored_then_drawn_by_the_loader_is_named(runs):
    first = _resume_findings(runs, "loader", "consumed", extra=("--loader",))[0]
    assert (first.kind, first.generator) == ("generator_consumed", "torch_cpu")
    assert "DataLoader iterator" in first.says and first.site.startswith("minigpt.py:")


@pytest.mark.slow
def test_a_time_seeded_private_generator_is_named_by_its_site(runs, tmp_path):
    a = _record(tmp_path / "a", "--bug", "timeseed")
    b = _record(tmp_path / "b", "--bug", "timeseed", reference=a)
    result = diff(a, b, allow_config_diff=True)
    findings = explain_independent(a, b, result.first_divergence.step)
    assert findings and findings[0].kind == "generator"
    assert findings[0].generator.startswith("user:minigpt.py:") and "seed it with a constant" in findings[0].says
    # what bisect reads from the same census: the private generator is a suspect (it differs and
    # the step draws from it); Python's and NumPy's global generators differ (unseeded) but
    # nobody draws from them: every census record that differs is weighed, the unused set aside
    suspects, unused = census_suspects(["rng.python"], a, b, 0, result.first_divergence.step)
    (private,) = suspects
    assert private.startswith("rng.user.minigpt.py:")
    assert unused[0] == "rng.python" and set(unused) <= {"rng.python", "rng.numpy"}, unused


def test_verify_prints_and_writes_the_finding(tmp_path):
    """The whole command, zero-code: the first finding in --json and in summary.json (in the
    fast suite: the end-to-end check that a broken resume is caught and named)."""
    out = tmp_path / "v"
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--json", "--out", str(out),
                           "--resume-with", f"{sys.executable} {SCRIPT} --out {{out}} --resume-from {{from}} --bug optim",
                           "--resume-at", str(CKPT_AT), "--", sys.executable, str(SCRIPT), "--out", "{out}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verdict"] == "fail"
    assert result["checks"]["independent"]["verdict"] == "identical"  # guarantee 1 held
    assert result["checks"]["resume"]["verdict"] == "diverged"  # guarantee 2 did not: named below
    assert result["findings"][0]["kind"] == "optimizer_state"
    assert "holds no state" in result["explanations"]["resume"][0]
    assert json.loads((out / "summary.json").read_text())["findings"] == result["findings"]
