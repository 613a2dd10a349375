"""The command line's own surface: help without the library, --version, 'did you mean'."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

import samebits
from samebits.cli import build_parser, command_modules, main

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def test_help_loads_no_torch():
    """`samebits --help` and every command's --help build the parser without the library: no torch, no
    numpy (they cost seconds; cli/_lazy.py imports them when a command runs)."""
    script = f"""
import json, sys
from samebits.cli import main
for argv in [["--help"]] + [[name, "--help"] for name in {COMMANDS!r}]:
    try:
        main(argv)
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in ("torch", "numpy", "samebits.stream", "samebits.runners") if m in sys.modules)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == []


def test_a_lazy_name_loads_its_module_when_called():
    from samebits.cli import diff as diff_command
    from samebits.compare import DiffResult

    assert isinstance(DiffResult.__new__(DiffResult), diff_command.DiffResult)
    assert diff_command.diff.resolve() is samebits.compare.diff


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"samebits {samebits.__version__}"


@pytest.mark.parametrize("typed, meant", [("verfy", "'verify'"), ("dif", "'diff'"), ("bisec", "'bisect'")])
def test_a_mistyped_command_gets_did_you_mean(typed, meant, capsys):
    assert main([typed, "runs/a"]) == 2
    err = capsys.readouterr().err
    assert f"samebits: error: unknown command '{typed}'; did you mean {meant}?" in err
    assert err.count("\n") == 2  # the usage line and the error, no list of every command


def test_a_word_like_no_command_is_refused_without_a_guess(capsys):
    assert main(["xyzzy"]) == 2
    assert "unknown command 'xyzzy'; `samebits --help` lists the commands" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["verify", "--steps", "10", "--", "python", "train.py"],
    ["verify", "--set", "seed=3", "--", "python", "train.py"],
    ["verify", "--across", "dp=1,2", "--steps", "3", "--", "python", "train.py", "{nproc}", "{out}"],
    ["tax", "--nproc", "2", "--", "python", "train.py", "{deterministic}"],
    ["tax", "--steps", "4", "--a", "python a.py", "--b", "python b.py"],
    ["bisect", "--nondeterministic", "--", "python", "train.py"],
    ["bisect", "--steps", "4", "--a", "python a.py", "--b", "python b.py"],
])
def test_recipe_options_with_a_command_are_refused_with_the_reason(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    option = next(a for a in argv if a in ("--steps", "--set", "--nproc", "--nondeterministic"))
    assert f"error: {option}: an option of the reference recipe, which runs only when no command is given" in err
    assert list(tmp_path.iterdir()) == []  # refused before anything ran or was written


def test_recipe_options_without_a_command_are_kept():
    args = build_parser().parse_args(["verify", "--steps", "3", "--set", "seed=2", "--nondeterministic"])
    assert (args.steps, args.overrides, args.nondeterministic) == (3, ["seed=2"], True)
    assert args.recipe_options_given == ["--steps", "--set", "--nondeterministic"]


def test_the_step_window_has_one_name(capsys):
    parser = build_parser()
    for command in (["run", "--out", "x"], ["verify"]):
        args = parser.parse_args([*command, "--record-steps", "2:5", "--", "python", "t.py"])
        assert args.record_steps == "2:5"
    assert capsys.readouterr().err == ""
    with pytest.raises(SystemExit) as done:  # the old spelling is gone (issue 36)
        main(["run", "--out", "x", "--steps", "2:5", "--", "python", "t.py"])
    assert done.value.code == 2 and "unrecognized arguments: --steps" in capsys.readouterr().err
    assert "--steps" not in _help(["run"])


def test_one_name_one_meaning_steps_counts_the_recipe_s_steps_and_stop_after_ends_a_program(capsys):
    """`--steps N` is the reference recipe's training steps wherever it is offered; a program of
    the user's is ended by `--stop-after STEP` (bisect, probe)."""
    commands = build_parser()._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        for action in sub._actions:
            if "--steps" in action.option_strings:
                assert action.help.startswith("recipe: training steps"), f"samebits {name} --steps: {action.help}"
            if "--stop-after" in action.option_strings:
                assert action.dest == "stop_after" and action.metavar == "STEP", name
    assert {name for name, sub in commands.items() if "--stop-after" in sub._option_string_actions} >= {"bisect", "probe"}
    assert build_parser().parse_args(["probe", "--stop-after", "0", "--", "python", "t.py"]).stop_after == 0
    assert "--steps" not in commands["probe"]._option_string_actions  # its old spelling is gone (issue 36)


def _help(command: list[str]) -> str:
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command[0]]
    return sub.format_help()


@pytest.mark.parametrize("name", COMMANDS)
def test_every_command_has_help_for_every_option_and_an_example_that_parses(name):
    import shlex

    sub = build_parser()._subparsers._group_actions[0].choices[name]
    undocumented = [a.option_strings or a.dest for a in sub._actions if not a.help]
    assert undocumented == [], f"samebits {name}: options without help"
    help_text = sub.format_help()
    assert "example(s):\n  samebits " + name in help_text
    for line in help_text.split("example(s):\n", 1)[1].splitlines():
        words = shlex.split(line, comments=True)
        assert words[:2] == ["samebits", name]
        build_parser().parse_args(words[1:])  # SystemExit(2) if the example does not parse


@pytest.mark.parametrize("name", command_modules())
def test_every_command_module_holds_its_own_examples(name):
    """A command's examples live in its module (`EXAMPLES`), so adding a command is adding a file;
    a module without them is named here, and its command still runs (issue 36)."""
    import importlib

    examples = getattr(importlib.import_module(f"samebits.cli.{name}"), "EXAMPLES", None)
    assert isinstance(examples, str) and examples.strip(), \
        f"src/samebits/cli/{name}.py has no EXAMPLES: give it a module-level string, one `samebits {name} ...` a line"
    assert all(line.startswith(f"samebits {name}") for line in examples.splitlines()), examples


def test_a_command_module_without_examples_still_builds_the_parser(monkeypatch):
    from samebits.cli import dump

    monkeypatch.delattr(dump, "EXAMPLES")
    sub = build_parser()._subparsers._group_actions[0].choices["dump"]
    assert "example(s)" not in sub.format_help()
    assert "example(s):\n  samebits show" in build_parser()._subparsers._group_actions[0].choices["show"].format_help()


_PLANTED = '''"""`samebits planted`: a command planted by a test."""

EXAMPLES = """\\
samebits planted --twice
"""


def register(sub) -> None:
    parser = sub.add_parser("planted", help="a planted command")
    parser.add_argument("--twice", action="store_true", help="say it twice")
    parser.set_defaults(func=lambda args: print("planted " * (2 if args.twice else 1)) or 0)
'''


def test_a_new_command_is_one_file(tmp_path, monkeypatch, capsys):
    """Issue 36: a module in samebits/cli with `register` and `EXAMPLES` is a command, its help and
    its examples included, with no other file touched; without EXAMPLES the other commands still
    run (the test above names it)."""
    import samebits.cli as cli

    monkeypatch.setattr(cli, "__path__", [*cli.__path__, str(tmp_path)])
    try:
        (tmp_path / "planted.py").write_text(_PLANTED)
        assert main(["planted", "--twice"]) == 0 and capsys.readouterr().out == "planted planted \n"
        sub = build_parser()._subparsers._group_actions[0].choices["planted"]
        assert sub.format_help().endswith("example(s):\n  samebits planted --twice\n")

        (tmp_path / "planted.py").write_text(_PLANTED.replace("EXAMPLES", "NOT_EXAMPLES"))
        del sys.modules["samebits.cli.planted"]
        assert main(["planted"]) == 0 and main(["show", "--json", str(tmp_path / "none")]) == 2
        assert "example(s)" not in build_parser()._subparsers._group_actions[0].choices["planted"].format_help()
    finally:
        sys.modules.pop("samebits.cli.planted", None)


def test_two_runs_have_one_metavar_convention():
    for name in ("diff", "trace"):
        assert f"samebits {name} [-h]" in _help([name]) and "RUN_A RUN_B" in _help([name])


def test_one_table_of_exit_codes_holds_every_code_samebits_gives():
    import re
    from pathlib import Path

    import samebits.cli as cli
    import samebits.verdicts as verdicts

    text = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    table = text.split("## Exit codes", 1)[1]
    documented = {int(code) for cell in re.findall(r"^\| ([\d, ]+) \|", table, re.M) for code in cell.split(",")}
    given = {value for module in (verdicts, cli) for name, value in vars(module).items()
             if name.startswith("EXIT_") and isinstance(value, int)}
    assert given <= documented, f"exit codes missing from docs/cli.md: {sorted(given - documented)}"
    assert verdicts.EXIT_STOPPED == 3


def test_a_mistyped_option_gets_did_you_mean(capsys):
    with pytest.raises(SystemExit) as done:
        main(["diff", "runs/a", "runs/b", "--form-step", "3"])
    assert done.value.code == 2
    assert "unrecognized arguments: --form-step 3 (--form-step: did you mean --from-step?)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["diff", "runs/a", "runs/b", "--zzz"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --zzz")
