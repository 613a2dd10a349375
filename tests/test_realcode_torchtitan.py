"""torchtitan 0.3.0's own training code under samebits (tests/realcode/torchtitan/).

The manifest's planted lines are checked always; the end-to-end check (slow) runs the
unmodified 1-rank llama3 debug model through `samebits verify` with its own DCP checkpoint
resume, and needs torchtitan installed (the `realcode` extra).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TITAN = ROOT / "tests" / "realcode" / "torchtitan"
CASES = json.loads((TITAN / "cases.json").read_text())["cases"]
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None

LAUNCH = [sys.executable, str(TITAN / "launch.py"), "--module", "tiny_llama3", "--config", "tiny"]
RESUME = ("--checkpoint.initial_load_path {from}/checkpoint/step-{step} "
          "--checkpoint.no-initial-load-model-only")


@pytest.mark.parametrize("case", [c for c in CASES if "planted" in c], ids=lambda c: c["name"])
def test_planted_line_is_marked(case):
    """Every fault case points at the `# PLANTED` line of a file in this folder that its commands run."""
    script, line = case["planted"].split(":")
    lines = (TITAN / script).read_text().splitlines()
    assert "# PLANTED" in lines[int(line) - 1], f"{case['name']}: {case['planted']} is not the marked line"
    commands = " ".join(case["run"] + case["samebits"])
    if script == "tiny_llama3.py":  # a config function: the case must select it
        function = next(re.match(r"def (\w+)\(", lines[n]).group(1) for n in range(int(line) - 1, -1, -1)
                        if lines[n].startswith("def "))
        assert re.search(rf"--config {function}(\s|$)", commands), f"{case['name']} does not use {function}"
    else:
        assert f"{{corpus}}/{script}" in commands, f"{case['name']} does not run {script}"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TORCHTITAN, reason="torchtitan is not installed (pip install -e '.[realcode]')")
def test_unmodified_torchtitan_passes_verify_and_its_resume(tmp_path):
    """torchtitan's unmodified run repeats bit for bit, and its own checkpoint of step 4 resumed in a
    fresh process equals the run that never stopped (FSDP2 DTensors, selective activation
    checkpointing, OptimizersContainer, DCP load's LR-0 init step, StatefulDataLoader)."""
    resume = " ".join(LAUNCH) + " --dump_folder {out} " + RESUME
    argv = [sys.executable, "-m", "samebits", "verify", "--json", "--out", str(tmp_path / "verify"),
            "--resume-at", "4", "--resume-with", resume, "--", *LAUNCH, "--dump_folder", "{out}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    said = f"exit {done.returncode}\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    assert done.returncode == 0, said
    result = json.loads(done.stdout)
    assert result["verdict"] == "pass", said
    assert result["checked"] == ["independent", "resume"], said
    assert result["gaps"] == {}, said
    independent, resumed = result["checks"]["independent"], result["checks"]["resume"]
    assert (independent["compared"]["steps"], resumed["compared"]["steps"]) == (10, 6), said
    assert independent["compared"]["records"] > 1000, said  # params, grads, optimizer state, forwards
