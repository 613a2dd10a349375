"""Terminal output: one table renderer that fits 100 columns, progress lines with elapsed time,
`samebits diff --all`, the hint for a run whose window starts later, and CLI messages that
name options (never library arguments)."""

from __future__ import annotations

import json
import re

import pytest
import torch

import samebits
import samebits.cli.bisect as cli_bisect
import samebits.cli.verify as cli_verify
from samebits.cli import main
from samebits.cli._format import TABLE_WIDTH, progress_printer, table
from samebits.errors import ConfigError
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

FINDING = ("origin: rank 0, step 3, phase backward, module (root), op aten::index_put, id /aten::index_put:0; "
           "7493 of 8192 elements differ in output 0 (a1 vs b1), max 504 ulp; call site train.py:21 in forward")


def test_a_long_cell_wraps_so_the_table_fits_100_columns_and_nothing_is_lost():
    assert len(FINDING) > 190
    rows = [["1. steps", "phases", "all steps, every rank", "a 15.9s b 15.1s", FINDING],
            ["2. modules", "modules", "step 0, then stop", "a 14.2s b 13.1s", "identical"]]
    text = table(["stage", "rung", "traced", "runs", "finding"], rows)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= TABLE_WIDTH, text
    assert lines[0].split() == ["stage", "rung", "traced", "runs", "finding"] and set(lines[1]) <= {"-", " "}
    # the finding column holds the whole text, wrapped: its words in order over the continuation lines
    column = lines[0].index("finding")
    wrapped = " ".join(line[column:].strip() for line in lines[2:] if len(line) > column and
                       not line.startswith("2. modules"))
    assert wrapped == FINDING
    # the first columns of continuation lines are blank: a row stays one row to the reader
    assert all(line[:column].strip() == "" for line in lines[3:-1])


def test_narrow_tables_are_unchanged_and_control_characters_stay_escaped_when_wrapped():
    assert table(["a", "b"], [["1", "x"]]) == "a  b\n-  -\n1  x"
    evil = "name\x1b[2J\x1b[31m" + "x" * 150 + "\u202eIDENTICAL"
    text = table(["phase", "name"], [["params", evil]])
    assert "\x1b" not in text and "\u202e" not in text
    assert "\\x1b[2J" in text and "\\u202e" in text.replace("\n", "").replace(" ", "")
    assert max(len(line) for line in text.splitlines()) <= TABLE_WIDTH
    assert len(table(["a"], [["y" * 300]], max_width=None).splitlines()[-1]) == 300  # no limit when asked


def test_progress_lines_carry_elapsed_time_and_indent_continuations(capsys):
    progress = progress_printer()
    progress("[1/3] run A ...")
    progress("samebits bisect: a = x\n b = y\x1b[31m")
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(r"\[\s*\d+\.\ds\] \[1/3\] run A \.\.\.", err[0]), err
    assert re.fullmatch(r"\[\s*\d+\.\ds\] samebits bisect: a = x", err[1])
    assert err[2] == " " * len("[   0.0s] ") + " b = y\\x1b[31m"


@pytest.mark.parametrize("module, target, argv", [
    (cli_verify, "verify", ["verify", "--", "python", "train.py"]),
    (cli_bisect, "bisect", ["bisect", "--", "python", "train.py"]),
])
def test_verify_and_bisect_print_progress_with_elapsed_time(monkeypatch, capsys, module, target, argv):
    def fake(*args, progress, **kwargs):
        progress("[1/3] run A: python train.py")
        raise ConfigError("stopped here by the test")

    monkeypatch.setattr(module, target, fake)
    assert main(argv) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert re.search(r"^\[\s*\d+\.\ds\] \[1/3\] run A: python train.py$", err, re.M), err


def _runs(tmp_path, *, start_c: int = 4):
    """a: steps 0..7; b: the same with two tensors and the loss changed at step 5; c: a's
    steps from ``start_c`` on (a resumed run), identical there."""
    for label, first in (("a", 0), ("b", 0), ("c", start_c)):
        rec = samebits.Recorder(tmp_path / label, rank=0, world_size=1, config={"lr": 0.1})
        for step in range(first, 8):
            changed = label == "b" and step >= 5
            w = torch.full((3,), float(step)) + (1e-3 if changed else 0.0)
            rec.metrics(step, loss=torch.tensor(float(step) * 0.5 + (1e-5 if changed else 0.0)))
            rec.tensors(step, "params", [("w", w), ("v", w * 2), ("same", torch.ones(2))])
        rec.close()
    return tmp_path / "a", tmp_path / "b", tmp_path / "c"


def test_diff_all_lists_every_differing_record_at_the_first_divergent_step(tmp_path, capsys):
    a, b, _ = _runs(tmp_path)
    assert main(["diff", str(a), str(b)]) == EXIT_BAD_VERDICT
    plain = capsys.readouterr().out
    assert "record(s) that differ" not in plain
    assert main(["diff", "--all", str(a), str(b)]) == EXIT_BAD_VERDICT
    out = capsys.readouterr().out
    assert "all 3 record(s) that differ at step 5 on rank 0:" in out
    listed = out.split("all 3 record(s)")[1]
    for name in ("loss", " w ", " v "):
        assert name in listed
    assert "same" not in listed and "ulp" in listed and "digest differs" in listed
    assert max(len(line) for line in listed.splitlines()) <= TABLE_WIDTH
    assert main(["diff", "--all", "--json", str(a), str(b)]) == EXIT_BAD_VERDICT
    payload = json.loads(capsys.readouterr().out)
    assert sorted(r["name"] for r in payload["differing_records"]) == ["loss", "v", "w"]
    assert main(["diff", "--all", "--by", "global", str(a), str(b)]) == EXIT_CANNOT_RUN
    assert "--by global already lists every" in capsys.readouterr().err


def test_diff_says_which_run_starts_later_and_the_option_to_use(tmp_path, capsys):
    a, _, c = _runs(tmp_path, start_c=4)
    # compared from step 4, where C starts; the steps before it are in A only: INCOMPLETE, with the option
    assert main(["diff", str(a), str(c)]) == EXIT_CANNOT_RUN
    out = capsys.readouterr().out
    assert "note: b starts at step 4 and a at step 0 (b resumed a run?): compared from step 4 on" in out
    assert "To judge the resume, compare the steps both hold: --from-step 4" in out
    assert main(["diff", str(c), str(a)]) == EXIT_CANNOT_RUN
    assert "a starts at step 4 and b at step 0" in capsys.readouterr().out
    assert main(["diff", "--from-step", "4", str(a), str(c)]) == EXIT_OK
    assert "IDENTICAL" in capsys.readouterr().out


def test_cli_messages_name_options_not_library_arguments(tmp_path, capsys):
    a, _, _ = _runs(tmp_path)
    rec = samebits.Recorder(tmp_path / "other", rank=0, world_size=1, config={"lr": 0.2})
    rec.metrics(0, loss=1.0)
    rec.close()
    assert main(["diff", str(a), str(tmp_path / "other")]) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "--allow-config-diff" in err and "allow_config_diff" not in err
    assert main(["diff", "--from-step", "-1", str(a), str(a)]) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "--from-step -1: steps are non-negative" in err and "start_step" not in err
    two = samebits.Recorder(tmp_path / "two", rank=0, world_size=2, config={"lr": 0.1})
    two.metrics(0, loss=1.0)
    two.close()
    assert main(["diff", str(a), str(tmp_path / "two")]) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "--by global" in err and "by='global'" not in err
