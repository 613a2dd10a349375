"""bisect gives every run its own new work folder, B resumes its first A's checkpoints
through {from}, and what to record (SAMEBITS_EXCLUDE) reaches every run (issue 33).

tests/scripts_bisect/auto_resume.py resumes by itself from the latest checkpoint in its output
folder (torchtitan, the HF Trainer): two runs in one folder and the second trains nothing.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from samebits import open_run
from samebits.cli import main
from samebits.errors import ConfigError
from samebits.runners.bisect import bisect
from samebits.runners.program import resume_bisect_command

SCRIPT = Path(__file__).parent / "scripts_bisect" / "auto_resume.py"
K = 2


@pytest.mark.slow
def test_the_printed_resume_bisect_runs_each_run_in_a_folder_of_its_own(tmp_path, capsys, monkeypatch):
    cmd = [sys.executable, str(SCRIPT), "--out", "{out}"]
    resume = [sys.executable, str(SCRIPT), "--out", "{out}", "--init-from", "{from}/ckpt-{step}.pt"]
    printed = resume_bisect_command(cmd, resume, K)  # what verify prints after a resume failure
    words = shlex.split(printed)
    assert words[:2] == ["samebits", "bisect"] and "&&" not in words, printed
    monkeypatch.setenv("SAMEBITS_EXCLUDE", "optimizer/*")  # what to record, as the user's environment says
    out = tmp_path / "bisect"
    code = main([*words[1:], "--out", str(out), "--json"])
    payload = json.loads(capsys.readouterr().out)
    # Before: every A ran in one folder, so a2 resumed a's last checkpoint and recorded nothing (exit 2).
    assert code == 0 and payload["verdict"] == "identical", payload
    steps = out / "1-steps"
    assert sorted(p.name for p in steps.iterdir()) == ["a", "a2", "b", "b2"]
    work = out / "work" / "1-steps"
    for label in ("a", "a2", "b", "b2"):
        assert (work / label / "ckpt-5.pt").is_file(), label  # each trained to the end in its own folder
        stream = open_run(steps / label).stream(0)
        blocks = list(stream.steps())
        assert [b.step for b in blocks] == [2, 3, 4], label  # a resume bisect records steps >= K
        names = {f"{r.phase}/{r.name}" for b in blocks for r in b.records()}
        assert names and not any(n.startswith("optimizer/") for n in names), (label, sorted(names)[:5])
    assert not (work / "b" / "ckpt-0.pt").exists()  # B started from A's checkpoint of step K


def test_step_and_from_belong_to_a_resumed_command_b(tmp_path):
    with pytest.raises(ConfigError, match=r"--b holds \{from\}"):
        bisect(["python", "x.py", "--out", "{out}"], ["python", "x.py", "--init-from", "{from}"], out=tmp_path / "r")
    with pytest.raises(ConfigError, match=r"--a holds \{step\}"):
        bisect(["python", "x.py", "--at", "{step}"], ["python", "x.py"], out=tmp_path / "s", b_step_offset=2)
