"""Tracing a step that runs in a closure (`optimizer.step(closure)`, as Lightning runs its
training_step): the closure's module forwards are in phase "forward", never "optimizer" (issue
33: on Lightning, bisect named the right op in the wrong phase, and at 2 steps did not localise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from samebits.stream import open_run

SCRIPT = Path(__file__).resolve().parent / "scripts_bisect" / "closure_step.py"


def test_a_closures_forward_is_the_forward_phase(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, SAMEBITS_TRACE="modules")
    proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(out), "-q", "--",
                           sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run = open_run(out)
    try:
        phases = [r.phase for block in run.stream(0).steps() for r in block.records()]
    finally:
        run.close()
    assert "trace:module:forward" in phases and "trace:phase:optimizer" in phases, sorted(set(phases))
    assert "trace:module:optimizer" not in phases, sorted(set(phases))
