"""Fail-safe recording (issue 33): samebits' code inside the user's process never changes the
program.  For each hook site, `SAMEBITS_TEST_FAULT_SITE` makes samebits' own work there raise; the
program's exit code, output (each step's loss bits, its final parameters' digest) must be those
of a plain run, and the verdict INCOMPLETE naming what could not be recorded, never PASS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from samebits.stream.gaps import SITES, read_gaps, summarise_gaps

SCRIPT = Path(__file__).resolve().parent / "scripts_failsafe" / "train.py"
STEPS = "4"


def _program_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step ", "final parameters"))]


@pytest.fixture(scope="module")
def plain_output() -> list[str]:
    proc = subprocess.run([sys.executable, str(SCRIPT), STEPS], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = _program_lines(proc.stdout)
    assert len(lines) == int(STEPS) + 1
    return lines


def _verify_with_fault(tmp_path: Path, site: str) -> tuple[int, dict]:
    env = dict(os.environ, SAMEBITS_TEST_FAULT_SITE=site)
    out = tmp_path / f"v-{site}"
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--out", str(out), "--json", "-q", "--",
                           sys.executable, str(SCRIPT), STEPS], capture_output=True, text=True, env=env, timeout=900)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _check_site(tmp_path: Path, site: str, plain_output: list[str]) -> None:
    if site == "startup":  # nothing recorded at all: exit 2 naming the gap, the runs' logs as they were
        env = dict(os.environ, SAMEBITS_TEST_FAULT_SITE=site)
        out = tmp_path / "v-startup"
        proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--out", str(out), "-q", "--",
                               sys.executable, str(SCRIPT), STEPS], capture_output=True, text=True, env=env,
                              timeout=900)
        assert proc.returncode == 2 and "samebits could not record it" in proc.stderr, proc.stderr
        assert "startup" in proc.stderr and "samebits bug" in proc.stderr, proc.stderr
        assert _program_lines((out / "logs" / "a.log").read_text()) == plain_output
        return
    code, payload = _verify_with_fault(tmp_path, site)
    out = Path(payload["out"])
    for run in payload["runs"]:  # the program ran as it does alone: exit code, every line
        assert run["exit_code"] == 0, (site, run)
        log = (out / "logs" / f"{run['name'].split()[0].lower()}.log").read_text()
        assert _program_lines(log) == plain_output, (site, run["name"])
    assert code == 2 and payload["verdict"] == "incomplete", (site, payload["verdict"])
    gaps = read_gaps(out / "a")
    assert gaps and all(g["site"].partition(".")[0] == site for g in gaps), gaps
    assert any(site in note and "samebits bug" in note for note in payload["notes"]), payload["notes"]


def test_a_failing_optimizer_hook_changes_nothing_and_the_verdict_is_incomplete(tmp_path, plain_output):
    _check_site(tmp_path, "optimizer_step", plain_output)
    # `samebits diff` holds gapped records to the same rule: never IDENTICAL on what is missing
    from samebits.compare import diff

    out = tmp_path / "v-optimizer_step"
    result = diff(out / "a", out / "b")
    assert result.verdict == "incomplete" and "samebits could not record" in result.incomplete[0], result


@pytest.mark.slow
@pytest.mark.parametrize("site", sorted(set(SITES) - {"optimizer_step"}))
def test_every_hook_site_fails_safe(tmp_path, plain_output, site):
    _check_site(tmp_path, site, plain_output)


def test_gaps_are_read_back_and_summarised(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "gaps-rank-00001.jsonl").write_text(
        json.dumps({"site": "forward", "step": 3, "records": "the outputs of GPT.forward", "error": "E: x",
                    "verdict": True}) + "\n" + "not json\n")
    gaps = read_gaps(run)
    assert [g["site"] for g in gaps] == ["forward", "unreadable"]  # a damaged line is never taken for none
    assert gaps[0]["rank"] == 1 and gaps[0]["log"].endswith("samebits-log-rank-00001.txt")
    line = summarise_gaps(gaps)
    assert "the outputs of GPT.forward (forward)" in line and "from step 3" in line and "samebits bug" in line


# --- what real trainers do, with PyTorch's own APIs (tests/scripts_failsafe/real_apis.py) -----

REAL_APIS = Path(__file__).resolve().parent / "scripts_failsafe" / "real_apis.py"


def _plain(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, str(REAL_APIS), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _program_lines(proc.stdout)


@pytest.mark.parametrize("ac", ["selective", "full"])
def test_fsdp2_activation_checkpointing_a_container_and_a_state_init_step_record_cleanly(tmp_path, ac):
    """FSDP2 (DTensors), SAC or full AC (the recompute in backward is no new forward, and samebits'
    ops never run inside SAC's mode), a container optimizer (recorded once, unprefixed) and DCP's
    zero-LR `_init_optim_state` (no training step): the program's output is a plain run's, every
    step has one forward, and the parameters carry global digests too."""
    from samebits.stream import open_run

    args = ["3", "--ac", ac]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(out), "-q", "--",
                           sys.executable, str(REAL_APIS), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _program_lines(proc.stdout) == _plain(*args)
    assert read_gaps(out) == []
    run = open_run(out)
    try:
        steps = {block.step: [(r.phase, r.name) for r in block.records()] for block in run.stream(0).steps()}
    finally:
        run.close()
    assert sorted(steps) == [0, 1, 2]  # the state-init step is not a step
    for step, names in steps.items():
        phases = [phase for phase, _ in names]
        assert phases.count("forward") == 1, (step, phases)
        assert {"grads", "params", "optimizer", "global:params"} <= set(phases), (step, sorted(set(phases)))
        assert not any(phase.startswith("optimizer") and "." in phase for phase in phases), phases


@pytest.mark.slow
def test_two_optimizers_have_names_that_two_processes_share(tmp_path):
    """A second optimizer's records are named by construction order, never id(): two
    bit-identical runs PASS (with id() in the name they FAILed: 'b: no such record')."""
    out = tmp_path / "v"
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--out", str(out), "--json", "-q", "--",
                           sys.executable, str(REAL_APIS), "3", "--no-fsdp", "--ac", "none", "--two"],
                          capture_output=True, text=True, timeout=900)
    payload = json.loads(proc.stdout)
    assert proc.returncode == 0 and payload["verdict"] == "pass", (payload["verdict"], payload.get("notes"))


def test_a_compiled_model_keeps_its_graph_under_recording(tmp_path):
    """samebits' hooks return before dynamo traces anything of theirs: the same graphs and no
    graph break (at the first version, a hook's `_current_graph_task_id()` broke the graph and
    the model ran eagerly: another program)."""
    script = Path(__file__).resolve().parent / "scripts_failsafe" / "compiled.py"
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(tmp_path / "run"), "-q", "--",
                           sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _program_lines(proc.stdout) == _program_lines(plain.stdout)
    assert "breaks 0" in proc.stdout and "'unique_graphs': 1" in proc.stdout, proc.stdout
