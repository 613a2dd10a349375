"""`samebits bisect --b-step-offset K`: bisect a resume (A against the command that resumes
A's checkpoint of step K), comparing only steps >= K; and verify's hint that prints it."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from samebits.cli import main
from samebits.errors import ConfigError
from samebits.runners.bisect import bisect

SCRIPT = Path(__file__).parent / "scripts_bisect" / "resume_rng.py"
K = 3


def _commands(ckpt: Path, restore_rng: bool) -> list[str]:
    base = [sys.executable, str(SCRIPT)]
    resume = base + ["--resume", str(ckpt)] + (["--restore-rng"] if restore_rng else [])
    return ["--a", shlex.join(base + ["--save-at", str(K), "--ckpt", str(ckpt)]), "--b", shlex.join(resume),
            "--b-step-offset", str(K)]


@pytest.mark.slow
def test_resume_that_forgets_the_rng_state_diverges_at_the_resume_step(tmp_path, capsys):
    code = main(["bisect", "--out", str(tmp_path / "o"), *_commands(tmp_path / "ckpt", False), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 1, payload
    origin = payload["origin"]
    assert payload["stages"][0]["finding"]["step"] == K
    assert origin["step"] == K and origin["kind"] == "generator", payload["conclusion"]
    assert origin["classification"] != "control_flow"
    assert "rng.torch_cpu" in origin["state_differs"]
    assert "torch CPU" in payload["conclusion"]


def test_resume_that_restores_the_rng_state_is_identical(tmp_path, capsys):
    code = main(["bisect", "--out", str(tmp_path / "o"), *_commands(tmp_path / "ckpt", True), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0, payload
    assert payload["verdict"] == "identical" and payload["origin"] is None


def test_bad_offsets_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="recipe"):
        bisect(None, None, out=tmp_path / "r", b_step_offset=2)
    with pytest.raises(ConfigError, match="negative"):
        bisect(["python", "x.py"], ["python", "y.py"], out=tmp_path / "n", b_step_offset=-1)
    assert main(["bisect", "--out", str(tmp_path / "c"), "--b-step-offset", "2"]) == 2  # the CLI: exit 2


def test_verify_resume_failure_hint_prints_the_resume_bisect(tmp_path, capsys):
    out = tmp_path / "v"
    resume = shlex.join([sys.executable, str(SCRIPT), "--resume", "{from}"])
    code = main(["verify", "--out", str(out), "--resume-with", resume, "--resume-at", str(K), "--",
                 sys.executable, str(SCRIPT), "--save-at", str(K), "--ckpt", "{out}"])
    text = capsys.readouterr().out
    assert code == 1, text
    hint = next(line for line in text.splitlines() if "samebits bisect --a" in line)
    assert f"--b-step-offset {K}" in hint
    command = hint.split("`")[1]
    words = shlex.split(command)
    side_a, side_b = (shlex.split(words[words.index(flag) + 1]) for flag in ("--a", "--b"))
    # The placeholders stay for bisect to fill per run: every run a new work folder of its own
    # ({out}), every B resuming the bisect's own first A ({from}).
    assert side_a[-2:] == ["--ckpt", "{out}"] and side_b[-2:] == ["--resume", "{from}"], command
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resume_bisect_command"] == command
