"""Fail-safe recording (issue 33): samebits' code inside the user's process never changes the
program.  For each hook site, `SAMEBITS_FAULT_SITE` makes samebits' own work there raise; the
program's exit code, output (each step's loss bits, its final parameters' digest) must be those
of a plain run, and the verdict INCOMPLETE naming what could not be recorded, never PASS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from samebits.autorecord._gaps import SITES, read_gaps, summarise_gaps

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
    env = dict(os.environ, SAMEBITS_FAULT_SITE=site)
    out = tmp_path / f"v-{site}"
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--out", str(out), "--json", "-q", "--",
                           sys.executable, str(SCRIPT), STEPS], capture_output=True, text=True, env=env, timeout=900)
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def _check_site(tmp_path: Path, site: str, plain_output: list[str]) -> None:
    if site == "startup":  # nothing recorded at all: exit 2 naming the gap, the runs' logs as they were
        env = dict(os.environ, SAMEBITS_FAULT_SITE=site)
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
