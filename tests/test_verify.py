"""`samebits verify` on the reference recipe: 2-rank gloo runs, both guarantees, and the
failures each guarantee must catch (nondeterministic path; a random state lost on resume)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from samebits.cli import main
from samebits.compare import DiffResult
from samebits.errors import SamebitsError
from samebits.verdicts import Verdict
from samebits.cli._recipe import recipe_program
from samebits.runners.verify import VerifyResult, verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recipe_verified(tmp_path_factory):
    """One `samebits verify --json` of the recipe (4 steps, resume at 2) with an exported
    OMP_NUM_THREADS=2, as on most clusters; the tests below each read it (a recipe verify is
    four 2-rank runs: A, B, C to its checkpoint, C resumed)."""
    out = tmp_path_factory.mktemp("recipe") / "v"
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(printed):
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        code = main(["verify", "--out", str(out), "--steps", "4", "--resume-at", "2", "--json"])
    return out, code, json.loads(printed.getvalue())


def test_both_guarantees_hold_on_the_recipe(recipe_verified):
    out, code, payload = recipe_verified
    assert code == 0, payload
    assert payload["verdict"] == "pass"
    assert payload["checked"] == ["independent", "resume"] and payload["not_checked"] == []
    independent, resume = payload["checks"]["independent"], payload["checks"]["resume"]
    assert independent["verdict"] == "identical" and independent["compared"]["ranks"] == 2
    assert independent["compared"]["steps"] == 4 and independent["compared"]["records"] > 0
    assert resume["verdict"] == "identical" and resume["compared"]["steps"] == 2
    assert (out / "summary.json").exists()


def test_nondeterministic_path_is_caught_and_located(tmp_path):
    result = verify(recipe_program(2, steps=4, nondeterministic=True), tmp_path / "v", resume_at=2)
    assert result.verdict == "fail"
    d = result.checks["independent"].first_divergence
    # index_put_(accumulate=True) in the MoE combine / embedding backward: first seen in gradients
    assert d.step == 0 and d.phase == "grads", d
    # the hint bisects the same recipe run, not the default one
    assert result.bisect_command == "samebits bisect --steps 4 --nproc 2 --nondeterministic"


def test_lost_random_state_breaks_resume_at_the_first_step_after_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_TEST_DROP_RNG", "router_jitter")  # applied when C resumes
    result = verify(recipe_program(2, steps=4), tmp_path / "v", resume_at=2)
    assert result.checks["independent"].identical
    d = result.checks["resume"].first_divergence
    assert result.verdict == "fail"
    # the run differs from step 2 on; the state census at its start (RUN/state, not part of
    # the verdict) names the router jitter generator
    assert d.step == 2 and d.phase != "state", d
    explained = result.explanations["resume"]
    assert any("step 2" in line and "generator 'router_jitter' state differs" in line for line in explained)


def test_bad_arguments_fail_clearly(tmp_path):
    with pytest.raises(SamebitsError, match="--resume-at 9 must be between 1 and 3"):
        verify(recipe_program(2, steps=4), tmp_path / "x", resume_at=9)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("x")
    with pytest.raises(SamebitsError, match="never overwrites"):
        verify(recipe_program(2, steps=4), tmp_path / "used")


RESUMABLE_SCRIPT = '''
import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)          # where this run saves its checkpoints
parser.add_argument("--resume-from", default=None)    # a checkpoint file to resume from
parser.add_argument("--no-rng", action="store_true")  # a resume that forgets the RNG state
parser.add_argument("--raise-at", type=int, default=None)
parser.add_argument("--exit-code", type=int, default=None)
parser.add_argument("--abort-at-teardown", action="store_true")
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
start = 0
if args.resume_from:
    state = torch.load(args.resume_from, weights_only=True)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"])
    if not args.no_rng:
        torch.set_rng_state(state["rng"])
    start = state["step"]
for step in range(start, 4):
    if step == args.raise_at:
        raise RuntimeError(f"planted failure at step {step}")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "rng": torch.get_rng_state(),
                "step": step}, f"{args.ckpt}/step-{step}.pt")
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad(); loss.backward(); opt.step()
if args.exit_code is not None:
    raise SystemExit(args.exit_code)
if args.abort_at_teardown:
    import os, signal

    class AbortAtTeardown:  # like a C++ destructor crashing after the interpreter's exit handlers
        def __del__(self, kill=os.kill, pid=os.getpid(), sig=signal.SIGABRT):
            kill(pid, sig)

    keep = AbortAtTeardown()
'''


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(RESUMABLE_SCRIPT)
    return [sys.executable, str(path)]


def test_verify_any_command_with_resume(tmp_path, script, capsys):
    resume = " ".join(script) + " --ckpt {out} --resume-from {from}/step-{step}.pt"
    out = tmp_path / "v"
    code = main(["verify", "--out", str(out), "--resume-with", resume, "--resume-at", "2", "--json", "--",
                 *script, "--ckpt", "{out}"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0, payload
    assert payload["verdict"] == "pass" and payload["checked"] == ["independent", "resume"]
    assert payload["checks"]["independent"]["compared"]["steps"] == 4
    assert payload["checks"]["resume"]["verdict"] == "identical"
    assert payload["checks"]["resume"]["compared"]["steps"] == 2
    # each run had its own work folder, and C resumed from A's checkpoint (not B's)
    assert (out / "work" / "a" / "step-3.pt").exists() and (out / "work" / "b" / "step-3.pt").exists()
    commands = {run["name"]: run["command"] for run in payload["runs"]}
    assert f"--ckpt {out}/work/c --resume-from {out}/work/a/step-2.pt" in commands["C (resume)"]


def test_a_resume_that_forgets_the_rng_names_it(tmp_path, script, capsys):
    resume = " ".join(script) + " --ckpt {out} --resume-from {from}/step-{step}.pt --no-rng"
    out = tmp_path / "w"
    code = main(["verify", "--out", str(out), "--resume-with", resume, "--resume-at", "2", "--",
                 *script, "--ckpt", "{out}"])
    text = capsys.readouterr().out
    assert code == 1, text
    assert text.startswith("samebits verify: FAIL (checked: independent and resume)")
    # the first difference is named from the state census, at the resume step
    assert "step 2, rank 0: torch CPU RNG state differs at step start" in text
    # hints point at the failing comparison (A against C from the resume step), never A against B
    assert f"samebits diff {out}/a {out}/c --from-step 2" in text
    assert f"samebits diff {out}/a {out}/b" not in text and "`samebits bisect`" not in text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checks"]["resume"]["first_divergence"]["step"] == 2
    assert any("torch CPU RNG" in line for line in summary["explanations"]["resume"])


def test_a_run_that_raises_is_a_failed_run_never_a_pass(tmp_path, script, capsys):
    code = main(["verify", "--out", str(tmp_path / "v"), "--", *script, "--ckpt", "{out}", "--raise-at", "3"])
    captured = capsys.readouterr()
    assert code == 2 and "PASS" not in captured.out
    assert "run A failed" in captured.err and "rank 0 ended with an uncaught exception" in captured.err
    assert "rank 0, step 3: RuntimeError: planted failure at step 3" in captured.err
    # a script that reports failure through its exit code is a failed run too
    code = main(["verify", "--out", str(tmp_path / "w"), "--", *script, "--ckpt", "{out}", "--exit-code", "1"])
    assert code == 2 and "exited with code 1 after its code ended" in capsys.readouterr().err


def test_a_crash_after_the_code_ended_is_tolerated_and_shown(tmp_path, script, capsys):
    code = main(["verify", "--out", str(tmp_path / "v"), "--json", "--", *script, "--ckpt", "{out}",
                 "--abort-at-teardown"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0, payload
    assert [run["exit_code"] for run in payload["runs"]] == [-6, -6]
    assert all(run["ended"].startswith("crashed at teardown (SIGABRT) after its code ended cleanly")
               for run in payload["runs"])


def test_the_verdict_says_what_was_not_checked(tmp_path, script, capsys):
    code = main(["verify", "--out", str(tmp_path / "v"), "--", *script, "--ckpt", "{out}"])
    text = capsys.readouterr().out
    assert code == 0
    assert text.startswith("samebits verify: PASS (checked: independent; not checked: resume)")
    assert "None" not in text and "NOT CHECKED" in text
    # CI that wants both guarantees: refused before anything runs, with the way to ask for resume
    assert main(["verify", "--out", str(tmp_path / "w"), "--require-resume", "--", *script, "--ckpt", "{out}"]) == 2
    assert "--require-resume: no resume check asked for. Give --resume-with" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def _check(verdict: Verdict) -> DiffResult:
    return DiffResult(a="a", b="b", verdict=verdict, first_divergence=None, ranks_diverged_first=[],
                      divergences={}, compared={"ranks": 1, "steps": 0, "records": 0})


@pytest.mark.parametrize("independent,resume,expected", [
    (Verdict.IDENTICAL, Verdict.IDENTICAL, Verdict.PASS),
    (Verdict.IDENTICAL, None, Verdict.PASS),
    (Verdict.IDENTICAL, Verdict.INCOMPLETE, Verdict.INCOMPLETE),
    (Verdict.INCOMPLETE, None, Verdict.INCOMPLETE),
    (Verdict.DIVERGED, Verdict.INCOMPLETE, Verdict.FAIL),
])
def test_verdict_is_proof_or_incomplete(independent, resume, expected):
    checks = {"independent": _check(independent), "resume": _check(resume) if resume else None}
    result = VerifyResult("out", checks, {}, 2)
    assert result.verdict is expected and result.to_dict()["verdict"] == expected.value
    assert result.verdict.exit_code == expected.exit_code


def test_a_run_that_refuses_shows_its_violations_first(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # deterministic mode refuses a Tree all-reduce
    with pytest.raises(SamebitsError) as caught:
        verify(recipe_program(1, steps=2), tmp_path / "v")
    message = str(caught.value)
    assert "[env-nccl-algo] NCCL_ALGO = 'Tree'" in message
    assert message.index("[env-nccl-algo]") < message.index("the end of its log")


def test_the_recipe_honours_an_exported_thread_count(recipe_verified):
    import samebits

    out, _, payload = recipe_verified  # run with OMP_NUM_THREADS=2 exported, as on most clusters
    assert Verdict(payload["verdict"]) is Verdict.PASS
    assert samebits.open_run(out / "a").header.config["num_threads"] == 2


DOCS = Path(__file__).resolve().parents[1] / "docs" / "resume.md"


def _docs_example(filename: str) -> tuple[str, list[list[str]]]:
    """docs/resume.md's script ``filename`` and the `samebits verify` commands after it."""
    text = DOCS.read_text()
    start = text.index(f"# file: {filename}")
    script = text[start:text.index("```", start)]
    commands = []
    for block in re.findall(r"```sh[^\n]*\n(.*?)```", text[start + 1:].split("# file:")[0], re.S):
        if block.startswith("samebits verify"):
            commands.append(shlex.split(block.replace("\\\n", " "))[1:])
    return script, commands


def _run_docs_command(argv, tmp_path, out, capsys):
    assert argv[0] == "verify"
    argv = [sys.executable if part == "python" else part.replace("python ", sys.executable + " ")
            for part in argv[1:]]
    code = main(["verify", "--out", str(out), *argv])
    return code, capsys.readouterr().out


def test_docs_resume_plain_pytorch_example_works(tmp_path, capsys, monkeypatch):
    script, (command,) = _docs_example("train.py")
    (tmp_path / "train.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    code, text = _run_docs_command(command, tmp_path, tmp_path / "v", capsys)
    assert code == 0 and text.startswith("samebits verify: PASS (checked: independent and resume)"), text
    # as the docs say: without restoring the torch RNG, the census names it at the resume step
    (tmp_path / "train.py").write_text(script.replace("    torch.set_rng_state(", "    # torch.set_rng_state("))
    code, text = _run_docs_command(command, tmp_path, tmp_path / "w", capsys)
    assert code == 1 and "step 4, rank 0: torch CPU RNG state differs at step start" in text, text


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_docs_resume_hf_trainer_example_works(tmp_path, capsys, monkeypatch):
    script, (passing, losing_rng) = _docs_example("train_hf.py")
    (tmp_path / "train_hf.py").write_text(script)
    monkeypatch.chdir(tmp_path)
    code, text = _run_docs_command(passing, tmp_path, tmp_path / "v", capsys)
    assert code == 0 and text.startswith("samebits verify: PASS (checked: independent and resume)"), text
    code, text = _run_docs_command(losing_rng, tmp_path, tmp_path / "w", capsys)
    assert code == 1 and "step 3, rank 0: torch CPU RNG state differs at step start" in text, text


TWO_RANK_SCRIPT = '''
import os, sys, torch
rank = int(os.environ["RANK"])
torch.manual_seed(rank)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    if rank == 1 and step == 2:
        raise ValueError("rank 1 broke")
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
'''


def test_under_torchrun_the_rank_that_raised_is_named(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TWO_RANK_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    assert main(["verify", "--out", str(tmp_path / "v"), "--", *cmd]) == 2
    err = capsys.readouterr().err
    assert "rank 1 ended with an uncaught exception" in err and "rank 1, step 2: ValueError: rank 1 broke" in err
    assert "rank None" not in err  # torchrun's own process is no rank
