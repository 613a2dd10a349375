"""The CLI's shared pieces: option groups defined once (`samebits.cli._options`), how a command
ends (`samebits.cli._format.print_result`), and the two `diff` renderers' shared verdict lines."""

from __future__ import annotations

import json

import pytest

from samebits.cli import build_parser, main
from samebits.cli._format import print_result
from samebits.cli.diff import _SHOWN, render, render_global
from samebits.compare import DiffResult, GlobalDiffResult
from samebits.runners._launch import DEFAULT_TIMEOUT_S
from samebits.verdicts import Verdict

# The commands that take each shared option (cli/matrix.py adds the recipe group too).
RECIPE = {"bisect": (4, 2), "tax": (30, 1), "verify": (8, 2), "matrix": (6, None)}
RUN_TIMEOUT = ("bisect", "replay", "tax", "verify")
OUT = ("bisect", "matrix", "replay", "tax", "verify")


def _actions(command: str) -> dict:
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    return {action.option_strings[0]: action for action in sub._actions if action.option_strings}


def test_shared_options_are_spelled_defaulted_and_documented_once():
    for command, (steps, nproc) in RECIPE.items():
        flags = _actions(command)
        assert flags["--steps"].default == steps, command
        if nproc is None:  # the command chooses ranks itself (matrix: each cell's)
            assert "--nproc" not in flags, command
        else:
            assert flags["--nproc"].default == nproc, command
        assert flags["--set"].dest == "overrides" and flags["--set"].default == []
        assert flags["--steps"].help == f"recipe: training steps per run (default {steps})"
    for command in RUN_TIMEOUT:
        action = _actions(command)["--run-timeout"]
        assert action.default == DEFAULT_TIMEOUT_S and f"(default {DEFAULT_TIMEOUT_S:g})" in action.help, command
    for command in OUT:
        assert _actions(command)["--out"].help == f"output directory (default: samebits-out/{command}-TIME)"


@pytest.mark.parametrize("argv", [
    ["bisect", "--steps", "0"], ["verify", "--nproc", "-1"], ["tax", "--steps", "x"],
    ["bisect", "--run-timeout", "0"], ["replay", "RUN", "--step", "1", "--run-timeout", "nan"],
    ["replay", "RUN", "--step", "1", "--nproc", "0"],
    ["matrix", "--steps", "0"], ["matrix", "--resume-at", "-2"],
])
def test_counts_and_timeouts_must_be_positive(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2  # argparse: could not run, nothing started
    option = next(a for a in argv if a in ("--steps", "--nproc", "--run-timeout", "--resume-at"))
    assert f"argument {option}: give a positive" in capsys.readouterr().err


class _Result:
    verdict = Verdict.DIVERGED

    def to_dict(self) -> dict:
        return {"verdict": "diverged"}


def test_print_result_prints_json_or_the_rendering_and_returns_the_verdicts_code(capsys):
    assert print_result(_Result(), True, lambda r: "never") == Verdict.DIVERGED.exit_code
    assert json.loads(capsys.readouterr().out) == {"verdict": "diverged"}
    assert print_result(_Result(), False, lambda r: "DIVERGED \x1b[2J") == Verdict.DIVERGED.exit_code
    assert capsys.readouterr().out == "DIVERGED \\x1b[2J\n"  # people's text is escaped


def test_both_diff_renderers_state_an_incomplete_verdict_the_same_way():
    reasons = [f"rank {r}: stream cut short" for r in range(_SHOWN + 5)]
    local = DiffResult(a="A", b="B", verdict=Verdict.INCOMPLETE, first_divergence=None, ranks_diverged_first=[],
                       divergences={}, compared={"ranks": 15, "steps": 3, "records": 9, "steps_identical_by_root": 3},
                       incomplete=reasons)
    global_ = GlobalDiffResult(a="A", b="B", verdict=Verdict.INCOMPLETE, first_step=None, tensors=[],
                               compared={"tensors": 0, "steps": 0, "ranks_a": 15, "world_size_a": 15, "ranks_b": 15,
                                         "world_size_b": 15}, incomplete=reasons)
    for text in (render(local), render_global(global_)):
        lines = text.splitlines()
        assert lines[1].startswith("INCOMPLETE: could not decide (no ")
        assert [line for line in lines if line.startswith("  - ")] == [f"  - {r}" for r in reasons[:_SHOWN]]
        assert "  ... and 5 more reason(s) (all of them: --json)" in lines
        assert lines[-1].startswith("compared: ")
    identical = DiffResult(a="A", b="B", verdict=Verdict.IDENTICAL, first_divergence=None, ranks_diverged_first=[],
                           divergences={}, compared=local.compared)
    assert render(identical).splitlines()[1].startswith("IDENTICAL: bit for bit. 15 rank(s) x 3 step(s)")
