"""`samebits verify` on runs it cannot compare (a resumed run that records other names): no
verdict (exit 2), and the advice it prints is a command that exists (issue 33: it advised
`--allow-config-diff`, which verify does not accept)."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys

import pytest

from samebits.cli import main

pytestmark = pytest.mark.slow  # three zero-code runs

TRAIN = '''
import argparse, os, torch
parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--resume")
parser.add_argument("--extra", action="store_true", help="one more layer: other recorded names")
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), *([torch.nn.Linear(4, 4)] if args.extra else []))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = 0
if args.resume:
    state = torch.load(args.resume)
    model.load_state_dict(state["model"], strict=False)
    start = state["step"]
for step in range(start, 4):
    torch.save({"model": model.state_dict(), "step": step}, os.path.join(args.out, f"step-{step}.pt"))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
'''


def test_runs_that_record_other_names_are_refused_with_advice_that_works(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "v"
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        code = main(["verify", "--out", str(out), "--resume-at", "2",
                     "--resume-with", f"{sys.executable} {script} --out {{out}} --resume {{from}}/step-{{step}}.pt --extra",
                     "--", sys.executable, str(script), "--out", "{out}"])
    message = printed.getvalue()
    assert code == 2 and "record different names" in message, message
    assert "pass --allow-config-diff" not in message  # verify has no such option
    advised = re.search(r"run `(samebits diff [^`]+)`", message)
    assert advised, message
    words = shlex.split(advised.group(1))
    assert words[2:] == [str(out / "a"), str(out / "c"), "--from-step", "2", "--allow-config-diff"]
    with contextlib.redirect_stdout(io.StringIO()) as shown:
        assert main(words[1:]) == 1  # the advised command runs and shows where A and C differ
    assert "DIVERGED at step 2" in shown.getvalue()
