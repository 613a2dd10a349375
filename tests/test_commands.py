"""Command templates: the recipe's one argv builder (`samebits.recipes.commands`), the runners'
shared placeholders and output folders (`samebits.runners.commands`), and the commands that fill
them per run: `bisect -- CMD` gives each run its own {out} as verify does; a `verify --across`
run of the recipe leaves the checkpoint `replay` resumes, and replay says how to make one."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

import samebits
from samebits.cli import main
from samebits.cli._recipe import recipe_program, replay_command, replay_config
from samebits.errors import ConfigError
from samebits.recipes.commands import recipe_command, recipe_roles, recorded_config_overrides
from samebits.runners.bisect import bisect
from samebits.runners.commands import RecipeRefused, default_out_dir, fill_placeholders, holds, prepare_out_dir
from samebits.runners.program import RECORD, RESUME, SAVE, SelfRecording, ZeroCode
from samebits.runners.replay import replay
from samebits.verdicts import Verdict

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node"]


def test_the_recipe_command_line_is_built_in_one_place_with_placeholders_left_in():
    assert recipe_command(1, steps=4, overrides=["seed=3"], out="{out}") == [
        sys.executable, "-m", "samebits.recipes", "--steps", "4", "--set", "seed=3", "--out", "{out}"]
    assert recipe_command(2, steps="{stop}", resume_from="{ckpt}", out="{out}") == [
        *TORCHRUN, "2", "-m", "samebits.recipes", "--steps", "{stop}", "--out", "{out}", "--resume-from", "{ckpt}"]
    roles = recipe_roles(2, steps=8, overrides=["seed=3"], nondeterministic=True)
    assert roles["save"][-7:] == ("--out", "{out}", "--save-at", "{step}", "--ckpt", "{ckpt}", "--keep-going")
    assert roles["save_only"][-4:] == ("--save-at", "{step}", "--ckpt", "{ckpt}") and "--out" not in roles["save_only"]
    assert roles["check"] == (sys.executable, "-m", "samebits.recipes", "--steps", "8", "--preset",
                              "nondeterministic", "--set", "seed=3", "--check")  # one process, trains nothing
    assert roles["bisect_words"] == ("samebits", "bisect", "--steps", "8", "--nproc", "2", "--set", "seed=3",
                                     "--nondeterministic")
    assert recorded_config_overrides({"seed": 3, "tp": None, "parallel": {"cell": "dp2"}}) == [
        "--set", "seed=3", "--set", "tp=none"]  # the mesh annotation is no setting
    with pytest.raises(ConfigError, match="--nproc 0 must be at least 1"):
        recipe_command(0)


def test_placeholders_are_filled_inside_words_and_out_dirs_are_never_reused(tmp_path):
    argv = ["train.py", "--out={out}/x", "--run", "{run}", "--from", "{from}"]
    assert fill_placeholders(argv, {"{out}": tmp_path, "{run}": "a"}) == [
        "train.py", f"--out={tmp_path}/x", "--run", "a", "--from", "{from}"]
    assert holds(argv, "{from}") and not holds(argv, "{step}")
    out = prepare_out_dir(tmp_path / "new", "verify")
    assert (out / "logs").is_dir()
    (out / "a").write_text("x")
    with pytest.raises(ConfigError, match="never overwrites runs"):
        prepare_out_dir(out, "verify")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        prepare_out_dir(tmp_path / "file", "verify")
    assert default_out_dir("tax").parent == Path("samebits-out") and default_out_dir("tax").name.startswith("tax-")


def test_a_self_recording_program_needs_out_in_its_templates_and_its_check_refuses_before_any_run(tmp_path):
    roles = recipe_roles(1, steps=2)
    with pytest.raises(ConfigError, match="the record command .* has no {out}"):
        SelfRecording(**{**roles, "record": roles["save_only"]})
    refused = recipe_program(1, steps=2, overrides=["no_such_field=1"])
    with pytest.raises(RecipeRefused, match="no_such_field"):
        refused.refuse_early()  # the recipe's own --check, in one process that trains nothing
    assert main(["bisect", "--out", str(tmp_path / "b"), "--nproc", "1", "--set", "no_such_field=1"]) == 2
    assert not (tmp_path / "b").exists()


WRITES_ITS_OUT = textwrap.dedent('''
    import argparse, pathlib, torch
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--run", required=True)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    assert not any(out.iterdir()), f"{out} is not this run's own folder: it holds {list(out.iterdir())}"
    (out / "ran").write_text(args.run)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
''')


def test_each_kind_of_program_gives_the_argv_and_environment_of_a_role(tmp_path):
    """The `Program` protocol: the recipe records itself (its own flags, its live check, what to
    record as SAMEBITS_* variables only when chosen); a command under zero-code recording gets
    its own work folder as {out}, the recording environment, and {step}/{from} only when resumed."""
    recipe = SelfRecording(**recipe_roles(2, steps=4), recording={"exclude": "optim*"})
    run = recipe.launch(RESUME, tmp_path / "c", values={"{ckpt}": tmp_path / "ckpt"}, reference=tmp_path / "a")
    assert run.argv[-2:] == ["--reference", str(tmp_path / "a")] and str(tmp_path / "ckpt") in run.argv
    assert run.env["SAMEBITS_EXCLUDE"] == "optim*" and run.streams == tmp_path / "c"
    assert SelfRecording(**recipe_roles(2, steps=4)).launch(SAVE, tmp_path / "a").env is None
    assert recipe.census_decides and recipe.resumes and recipe.verify_resume_step(None, False) == 2

    command = ZeroCode(("python", "t.py", "--out", "{out}", "--run", "{run}"),
                       resume=("python", "t.py", "--from", "{from}", "--at", "{step}"))
    run = command.launch(RECORD, tmp_path / "b", work=tmp_path / "w", values={"{step}": 3})
    assert run.argv == ["python", "t.py", "--out", str(tmp_path / "w"), "--run", "b"] and (tmp_path / "w").is_dir()
    assert run.env["SAMEBITS_DIR"] == str(tmp_path / "b") and "SAMEBITS_STEP_OFFSET" not in run.env
    resumed = command.launch(RESUME, tmp_path / "c", values={"{step}": 3, "{from}": "A"}, step_offset=3)
    assert resumed.argv[-4:] == ["--from", "A", "--at", "3"] and resumed.env["SAMEBITS_STEP_OFFSET"] == "3"
    assert not command.census_decides and command.resumes and command.notes() == []
    with pytest.raises(ConfigError, match="--resume-with needs --resume-at K"):
        command.verify_resume_step(None, False)
    with pytest.raises(ConfigError, match="--resume-at bisects a program that can save its checkpoint"):
        bisect(program=command, resume_at=2, out=tmp_path / "never")  # a command has no save-and-exit role
    assert not (tmp_path / "never").exists()


def test_bisect_of_a_command_gives_each_run_its_own_out_folder_as_verify_does(tmp_path, monkeypatch):
    """The hint verify prints, `samebits bisect -- python train.py --out {out}`, ran with a
    literal ./{out} shared by both runs; now each run gets a new folder, and {run} its label."""
    script = tmp_path / "train.py"
    script.write_text(WRITES_ITS_OUT)
    monkeypatch.chdir(tmp_path)
    result = bisect([sys.executable, str(script), "--out", "{out}", "--run", "{run}"], out=tmp_path / "bisect",
                    run_timeout=300)
    assert result.verdict is Verdict.IDENTICAL, result.to_dict()
    assert not (tmp_path / "{out}").exists()
    ran = sorted(p.relative_to(tmp_path / "bisect" / "work") for p in (tmp_path / "bisect" / "work").rglob("ran"))
    assert [str(p.parent) for p in ran] == ["1-steps/a", "1-steps/b", "2-steps/a", "2-steps/b"], ran
    assert {(p.parent.name, (tmp_path / "bisect" / "work" / p).read_text()) for p in ran} == {("a", "a"), ("b", "b")}


def _invariant_run(path: Path, steps: int) -> Path:
    with samebits.Recorder(path, rank=0, world_size=2, config={"grad_reduce": "invariant", "seed": 0}) as rec:
        for step in range(steps):
            rec.metrics(step, loss=1.0)
            rec.end_step(step)
    return path


def test_replay_of_the_recipe_says_how_to_make_a_run_with_a_checkpoint(tmp_path):
    run = _invariant_run(tmp_path / "across" / "dp2", 4)
    with pytest.raises(ConfigError, match=r"no checkpoint folder .*ckpt.*`samebits verify --across` on the recipe "
                                          r"saves each size's checkpoint"):
        replay(run, step=2, cmd=replay_command(1), recorded_config=replay_config, out=tmp_path / "r1")
    (run / "ckpt" / "step-3").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"checkpoints of steps \[3\], none at or before --step 2: replay a step "
                                          "from 3 on"):
        replay(run, step=2, cmd=replay_command(1), recorded_config=replay_config, out=tmp_path / "r2")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()  # refused before any folder


def test_replay_of_the_recipe_resumes_the_newest_checkpoint_at_or_before_the_step(tmp_path):
    run = _invariant_run(tmp_path / "dp2", 4)
    for step in (0, 1, 3):
        (run / "ckpt" / f"step-{step}").mkdir(parents=True)
    # a command that fails at once: its argv (in the error) shows what replay ran
    with pytest.raises(samebits.SamebitsError) as failed:
        replay(run, step=2, cmd=[sys.executable, "-c", "import sys; sys.exit(5)", "{ckpt}", "{stop}"],
               recorded_config=replay_config, out=tmp_path / "r")
    assert f"{run / 'ckpt' / 'step-1'} 3 --set grad_reduce=invariant --set seed=0" in str(failed.value)


@pytest.mark.slow
def test_a_verify_across_run_of_the_recipe_replays_as_the_readme_says(tmp_path, capsys):
    """README: `samebits verify --across dp=1,2` then `samebits replay RUN --step K --nproc N`
    (here N = the run's own size: the recipe's checkpoint loads at its saved layout only)."""
    out = tmp_path / "across"
    assert main(["verify", "--across", "dp=1,2", "--steps", "2", "--out", str(out), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["layouts"] == ["single", "dp2"] and shown["checks"]["dp2"]["by"] == "global"
    assert [(c["run"], c["differs"]) for c in shown["controls"]] == [("control-dp2", True)]  # the dp=N form works
    assert (out / "single" / "ckpt" / "step-1").is_dir() and (out / "certificate.json").is_file()
    code = main(["replay", str(out / "single"), "--step", "1", "--nproc", "1", "--out", str(tmp_path / "r"), "--json"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["verdict"] == "identical", shown
    assert shown["check"]["compared"]["steps"] == 1


def test_the_cli_builds_the_recipe_programs_only_without_a_command_of_the_users(tmp_path, monkeypatch):
    seen = {}

    def fake_tax(out, **kwargs):
        seen.update(kwargs)
        raise ConfigError("stop here")

    monkeypatch.setattr("samebits.cli.tax.tax", fake_tax)
    assert main(["tax", "--out", str(tmp_path / "t"), "--steps", "5", "--nproc", "2", "--set", "seed=1"]) == 2
    programs = seen["programs"]
    assert programs["deterministic"].record[-4:] == ("--set", "deterministic=true", "--out", "{out}")
    assert "deterministic=false" in programs["baseline"].record and programs["baseline"].nproc == 2
    assert "seed=1" in programs["baseline"].record and programs["baseline"].steps == 5
    assert main(["tax", "--out", str(tmp_path / "u"), "--", "python", "t.py", "{deterministic}"]) == 2
    assert {label: program.argv for label, program in seen["programs"].items()} == {
        "deterministic": ("python", "t.py", "1"), "baseline": ("python", "t.py", "0")}
