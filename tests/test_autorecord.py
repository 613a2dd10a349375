"""Zero-code recording: a plain script (no samebits import) yields comparable streams."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import samebits
from samebits.cli import main

SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    for step in range(int(sys.argv[1])):
        x = torch.randn(32, 8, generator=gen)
        if len(sys.argv) > 2 and step == int(sys.argv[2]):
            x[0, 0] += 1e-3                      # a planted change at one step
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad(); loss.backward(); opt.step()
""")


def test_zero_code_recording_of_a_plain_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    runs = {}
    for name, extra in (("a", []), ("b", []), ("c", ["2"])):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(out), "--",
                               sys.executable, str(script), "4", *extra], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert "recorded 1 rank(s), 4 step(s)" in proc.stderr
        runs[name] = out
    assert samebits.diff(runs["a"], runs["b"]).identical
    result = samebits.diff(runs["a"], runs["c"], allow_config_diff=True)  # the command differs
    d = result.first_divergence
    assert (d.step, d.phase, d.name) == (2, "forward", "Sequential")
    reader = samebits.open_run(runs["a"]).stream(0)
    phases = {r.phase for r in next(iter(reader.steps())).records()}
    assert phases == {"forward", "grads", "params", "optimizer"}
    names = {r.name for r in next(iter(samebits.open_run(runs["a"]).stream(0).steps())).records()}
    assert {"0.weight", "2.bias", "0.weight.exp_avg"} <= names


def test_run_reports_a_missing_program(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "x"), "--", "no-such-program-xyz"]) == 2
    assert "no such program" in capsys.readouterr().err
