"""A verify that is stopped leaves a summary saying so (issue 34 item 9): killed by SIGINT or
SIGTERM (its runs are ended, it exits 128 + the signal), killed by SIGKILL itself, or a run
killed under it (a worker's SIGKILL: the run did not finish, exit 2), `OUT/summary.json` says
verdict "stopped" with why and the runs that had ended, and `samebits report OUT` shows that
and exits 3 (docs/cli.md).  Before, a killed verify left no summary at all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from samebits.cli import main
from samebits.runners._launch import RunFailed
from samebits.runners.program import ZeroCode
from samebits.runners.verify import verify

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def _wait_for(predicate, timeout: float = 120.0) -> None:
    began = time.monotonic()
    while not predicate():
        assert time.monotonic() - began < timeout, "timed out"
        time.sleep(0.2)


@pytest.mark.parametrize("signum, code, says", [
    (signal.SIGINT, 130, "stopped by SIGINT (exit 130)"),
    pytest.param(signal.SIGTERM, 143, "stopped by SIGTERM (exit 143)", marks=pytest.mark.slow),
    pytest.param(signal.SIGKILL, -9, "the command did not finish: it was killed", marks=pytest.mark.slow),
], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_killed_verify_leaves_a_summary_marked_stopped(tmp_path, capsys, signum, code, says):
    out = tmp_path / "v"
    # signals at their defaults, as in a terminal (tests started in the background inherit SIGINT ignored)
    process = subprocess.Popen([sys.executable, "-m", "samebits", "verify", "-q", "--out", str(out), "--",
                                *SLEEPER], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for(lambda: (out / "logs" / "a.log").exists())  # run A is going
        time.sleep(0.5)
        process.send_signal(signum)
        assert process.wait(timeout=180) == code, process.stderr.read().decode()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    summary = _summary(out)
    assert summary["verdict"] == "stopped" and summary["exit_code"] == 3
    assert summary["stopped"].startswith(says), summary["stopped"]
    assert summary["runs"] == []  # A had not ended
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 3
    printed = capsys.readouterr().out
    assert "samebits report: STOPPED" in printed and f"STOPPED: {summary['stopped']}" in printed


def test_a_run_killed_under_verify_is_marked_with_why(tmp_path):
    out = tmp_path / "v"
    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    with pytest.raises(RunFailed):
        verify(ZeroCode(tuple(killed)), out)
    summary = _summary(out)
    assert summary["verdict"] == "stopped" and summary["stopped"].startswith("run A did not finish: ")
    assert "SIGKILL" in summary["stopped"] or "-9" in summary["stopped"], summary["stopped"]


def test_the_finished_summary_replaces_the_stopped_one(tmp_path):
    out = tmp_path / "v"
    script = tmp_path / "t.py"
    script.write_text("import samebits, torch\n"
                      "with samebits.Recorder() as rec:\n"
                      "    for step in range(2):\n"
                      "        rec.metrics(step, loss=1.0)\n"
                      "        rec.end_step(step)\n")
    result = verify(ZeroCode((sys.executable, str(script))), out)
    summary = _summary(out)
    assert summary["verdict"] == result.verdict.value != "stopped"
    assert [run["name"] for run in summary["runs"]] == ["A", "B"]
    assert not list(out.glob("*.tmp"))
