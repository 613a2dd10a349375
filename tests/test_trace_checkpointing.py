"""Tracing leaves a checkpoint library's own work out of what it compares (issue 33): DCP's
save broadcasts a fresh random save_id every run, and bisect called a bit-identical run
"not repeatable"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from samebits import open_run
from samebits.trace import find_origins
from samebits.trace._checkpointing import issued_by_checkpointing

SCRIPT = Path(__file__).parent / "scripts_bisect" / "dcp_save.py"


@pytest.mark.slow  # two traced runs that import torch.distributed.checkpoint
def test_a_dcp_save_in_every_step_leaves_two_identical_runs_identical(tmp_path):
    runs = []
    for label in ("a", "b"):
        out = tmp_path / label
        env = {**os.environ, "SAMEBITS_TRACE": "ops"}
        proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(out), "--", sys.executable,
                               str(SCRIPT), "--out", str(tmp_path / f"{label}-work")],
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert (tmp_path / f"{label}-work" / "step-3" / ".metadata").is_file()  # DCP saved, as the program asked
        runs.append(out)
    report = find_origins(*runs)
    # Before: "input 0 of world/broadcast:2 already differed" at step 1 (the save after step 0).
    assert report.identical, [f.where() for f in report.findings.values()]
    events = {r.name.partition("|")[0] for block in open_run(runs[0]).stream(0).steps()
              for r in block.records() if r.phase.startswith("trace:collective")}
    assert "world/all_reduce:0" in events and not any("broadcast" in e for e in events), sorted(events)


def test_only_frames_of_torch_distributed_checkpoint_count():
    assert not issued_by_checkpointing()
    checkpoint_file = os.path.join(os.path.dirname(torch.__file__), "distributed", "checkpoint", "utils.py")
    namespace: dict = {"issued": issued_by_checkpointing}
    exec(compile("def inside():\n    return issued()\n", checkpoint_file, "exec"), namespace)
    assert namespace["inside"]()
