"""Zero-code recording: a plain script (no samebits import) yields comparable streams."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import samebits
from samebits.autorecord import STATE_DIR, read_outcomes
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
    assert phases == {"forward", "backward", "grads", "params", "optimizer"}
    names = {r.name for r in next(iter(samebits.open_run(runs["a"]).stream(0).steps())).records()}
    assert {"0.weight", "2.bias", "0.weight.exp_avg"} <= names
    # the state census of each step start, in its own stream (not part of the verdict)
    census = samebits.open_run(runs["a"] / STATE_DIR).stream(0)
    blocks = list(census.steps())
    assert [b.step for b in blocks] == [0, 1, 2, 3]
    first = {r.name for r in blocks[0].records() if r.phase == "state"}
    # the optimizer is in the census from its construction, before its first step; the
    # generator the script makes is named by where it was made
    assert {"rng.python", "rng.torch_cpu", "optim0.step", "optim0.lr", "optim0.hparams"} <= first
    assert any(name.startswith("rng.user.train.py:") for name in first), first
    phases = {r.phase for r in blocks[0].records()}
    # every process's first step holds restored.*: a fresh one's are its initial parameters
    assert phases == {"state", "inputs", "state_end", "restored.params"}  # no optimizer state yet
    assert {r.phase for r in blocks[1].records()} == {"state", "inputs", "state_end"}
    (outcome,) = read_outcomes(runs["a"])
    assert (outcome["ended"], outcome["rank"], outcome["streams_closed"]) == ("clean", 0, True)


LOGITS_SCRIPT = textwrap.dedent("""
    import struct, sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(2, 6, 8, generator=gen)
        y = torch.randint(0, 4, (2, 6), generator=gen)
        if len(sys.argv) > 1 and step == 1:
            y[0, 0] = (y[0, 0] + 1) % 4          # planted: a label, which no module sees
        opt.zero_grad()
        for micro in range(2):                   # gradient accumulation: two backward() per step
            logits = model(x[micro])             # the model returns logits, not a loss
            loss = torch.nn.functional.cross_entropy(logits, y[micro]) / 2
            print("loss", step, micro, struct.pack("<f", loss.item()).hex())
            loss.backward()
        opt.step()
""")


def test_the_root_passed_to_backward_is_recorded(tmp_path):
    """A plain loop whose model returns logits: the loss exists only as the root of
    ``backward()``.  It is recorded with its exact bits, once per call (two micro-batches),
    and a change that no module sees (a label) is caught at the root, before the gradients."""
    script = tmp_path / "train.py"
    script.write_text(LOGITS_SCRIPT)
    a = _samebits_run("--out", tmp_path / "a", "--", sys.executable, script)
    b = _samebits_run("--out", tmp_path / "b", "--", sys.executable, script, "planted")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    printed = {}
    for line in a.stdout.splitlines():
        _, step, micro, bits = line.split()
        printed[int(step), int(micro)] = bits
    for block in samebits.open_run(tmp_path / "a").stream(0).steps():
        roots = [r for r in block.records() if r.phase == "backward"]
        assert [(r.kind, r.name, r.occurrence) for r in roots] == [("metric", "root", 0), ("metric", "root", 1)]
        for root in roots:  # the exact float32 bits the script computed
            assert (root.dtype, root.raw.hex()) == ("float32", printed[block.step, root.occurrence])
    result = samebits.diff(tmp_path / "a", tmp_path / "b", allow_config_diff=True)
    d = result.first_divergence
    assert (d.step, d.phase, d.name, d.occurrence) == (1, "backward", "root", 0)


def test_run_reports_a_missing_program(tmp_path, capsys):
    assert main(["run", "--out", str(tmp_path / "x"), "--", "no-such-program-xyz"]) == 2
    assert "no such program" in capsys.readouterr().err


def _samebits_run(*args):
    return subprocess.run([sys.executable, "-m", "samebits", "run", *map(str, args)], capture_output=True,
                          text=True)


def test_run_refuses_a_used_out_before_starting_the_command(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + "\nopen(sys.argv[0] + '.ran', 'w').close()\n")
    assert _samebits_run("--out", tmp_path / "a", "--", sys.executable, script, 2).returncode == 0
    (tmp_path / "train.py.ran").unlink()
    for used in (tmp_path / "a", script):  # a directory holding streams; a file
        done = _samebits_run("--out", used, "--", sys.executable, script, 2)
        assert done.returncode == 2 and "samebits run: error: --out" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
        assert not (tmp_path / "train.py.ran").exists()  # the command never started


def test_run_reference_stops_visibly_at_the_first_divergent_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert _samebits_run("--out", tmp_path / "a", "--", sys.executable, script, 5).returncode == 0
    done = _samebits_run("--out", tmp_path / "b", "--reference", tmp_path / "a", "--",
                         sys.executable, script, 5, 2)
    assert done.returncode == 3, done.stderr  # EXIT_STOPPED, as the stopped process itself (docs/cli.md)
    assert f"STOPPED at step 2 (rank 0): it differs from the reference {tmp_path / 'a'}" in done.stderr
    assert "samebits: step 2 on rank 0 differs from the reference run" in done.stderr
    assert "first divergence: step 2, rank 0: forward/Sequential" in done.stderr
    steps = [b.step for b in samebits.open_run(tmp_path / "b").stream(0).steps()]
    assert steps == [0, 1, 2]  # nothing computed after the answer was known


def test_run_step_offset_numbers_a_resumed_run_like_the_original(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = _samebits_run("--out", tmp_path / "c", "--step-offset", 3, "--", sys.executable, script, 2)
    assert done.returncode == 0, done.stderr
    assert [b.step for b in samebits.open_run(tmp_path / "c").stream(0).steps()] == [3, 4]


def test_an_uncaught_exception_is_written_to_the_outcome_file(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("opt.zero_grad()", "assert step < 2, 'planted'\n    opt.zero_grad()"))
    done = _samebits_run("--out", tmp_path / "a", "--", sys.executable, script, 4)
    assert done.returncode == 1
    assert "rank 0 raised AssertionError: planted at step 2" in done.stderr
    (outcome,) = read_outcomes(tmp_path / "a")
    assert outcome["ended"] == "exception" and outcome["step"] == 2
    assert outcome["traceback_tail"][-1] == "AssertionError: planted"


def test_a_program_that_ends_with_os_exit_still_closes_its_streams(tmp_path):
    # os._exit skips atexit (the reference recipe ends so): before, the streams stayed open, the
    # step times empty and no outcome was written. A forked child that ends with os._exit (as a
    # DataLoader worker does) must not close its parent's streams: the parent records on.
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("opt.zero_grad()", "if step == 1 and os.fork() == 0:\n        os._exit(0)\n"
                                     "    opt.zero_grad()").replace("import sys, torch", "import os, sys, torch")
                      + "\nsys.stdout.flush()\nos._exit(0)\n")
    done = _samebits_run("--out", tmp_path / "a", "--", sys.executable, script, 4)
    assert done.returncode == 0, done.stderr
    run = samebits.open_run(tmp_path / "a")
    assert run.closed_cleanly() and [b.step for b in run.steps(0)] == [0, 1, 2, 3]
    assert not list((tmp_path / "a").rglob("*.lock"))
    assert (tmp_path / "a" / "rank-00000.steptimes").read_text().count("\n") >= 4
    (outcome,) = read_outcomes(tmp_path / "a")
    assert outcome["ended"] == "clean" and outcome["streams_closed"] is True


def test_zero_code_recordings_own_work_is_never_traced(tmp_path):
    """At rung 3 the dispatch mode sees every op of a traced step; zero-code recording's own
    work (the state census at the first forward, detach and digests in its hooks) runs inside
    the tracer's ``suspended()``, so it leaves no op record (the census's ``copy_`` and
    ``lift_fresh`` would show at scope "" of the forward) and shifts no op id."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "ops"
    env = {**os.environ, "SAMEBITS_TRACE": "ops", "SAMEBITS_TRACE_STEPS": "1"}
    proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(out), "--",
                           sys.executable, str(script), "2"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    blocks = {b.step: b.records() for b in samebits.open_run(out).stream(0).steps()}
    ops = [r.name.partition("|")[0] for r in blocks[1] if r.phase.startswith("trace:op:")]
    assert any(name.startswith("0/aten::addmm") for name in ops)  # the program's ops are traced
    foreign = [name for name in ops
               if name.rpartition("/")[2].rpartition(":")[0] in ("aten::copy_", "aten::lift_fresh", "aten::detach")]
    assert not foreign, foreign


def test_closing_the_tracer_keeps_a_backward_wrapper_installed_after_it():
    """Zero-code recording wraps torch.autograd.backward on top of the tracer's wrapper; a
    tracer closed first must not take that wrapper away with its own."""
    import torch

    from samebits.trace import _tracer

    torchs_own, torchs_grad = torch.autograd.backward, torch.autograd.grad
    _tracer._patch_autograd()
    assert torch.autograd.backward is not torchs_own
    _tracer._unpatch_autograd()
    assert torch.autograd.backward is torchs_own  # nothing on top: restored exactly

    _tracer._patch_autograd()
    tracers = torch.autograd.backward
    roots = []

    def recording(tensors, *args, **kwargs):  # what autorecord._wrap_backward installs
        roots.append(tensors)
        return tracers(tensors, *args, **kwargs)

    torch.autograd.backward = recording
    try:
        _tracer._unpatch_autograd()
        assert torch.autograd.backward is recording
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()  # through the recording wrapper and the inert tracer wrapper
        assert len(roots) == 1 and x.grad.tolist() == [3.0, 3.0]
        _tracer._patch_autograd()  # tracing anew reuses the wrapper still in the chain
        assert torch.autograd.backward is recording
    finally:
        torch.autograd.backward = tracers
        _tracer._unpatch_autograd()
        assert torch.autograd.backward is torchs_own and torch.autograd.grad is torchs_grad
