"""`samebits diff` of a resumed run and of runs whose command lines differ only in output paths
(issue 27): the documented commands of docs/resume.md's "Doing it by hand" compare as written."""

from __future__ import annotations

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.compare import output_paths_only
from samebits.errors import IncomparableRunsError

NUM_STEPS = 6


def _record(directory, command: str, *, first: int = 0, flip_at: int | None = None, steps: str | None = None):
    """A run of 2 ranks whose values follow one deterministic recurrence; steps before ``first``
    are computed but not written (a resumed run), ``flip_at`` flips a bit of a parameter there."""
    for rank in range(2):
        params = {f"w{i}": torch.randn(4, 3, generator=torch.Generator().manual_seed(rank * 10 + i))
                  for i in range(3)}
        with samebits.Recorder(directory, rank=rank, world_size=2, config={"command": command},
                               steps=steps) as rec:
            for step in range(NUM_STEPS):
                if step == flip_at:
                    params["w1"].view(torch.int32).view(-1)[0] ^= 1
                if step >= first:
                    rec.metrics(step, loss=float(sum(p.sum() for p in params.values())))
                    rec.tensors(step, "params", params.items())
                params = {name: p * 0.9 + 0.01 for name, p in params.items()}
    return directory


@pytest.fixture
def runs(tmp_path, monkeypatch):
    """Each run writes its checkpoints into its own folder (``--ckpt-dir a/ckpt``, from tmp_path),
    so that their values are paths the runs wrote (issue 34 item 7)."""
    monkeypatch.chdir(tmp_path)
    a = _record(tmp_path / "a", "python train.py --ckpt-dir a/ckpt")
    b = _record(tmp_path / "b", "python train.py --ckpt-dir b/ckpt")
    c = _record(tmp_path / "c", "python train.py --ckpt-dir c/ckpt --resume a/ckpt/step-4.pt", first=4)
    for run in (a, b, c):
        (run / "ckpt").mkdir()
    return a, b, c


def test_commands_that_differ_only_in_output_paths_compare_and_say_so(runs, capsys):
    a, b, _ = runs
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL" in out
    assert "note: the recorded command lines differ only in where they write: --ckpt-dir a/ckpt / b/ckpt" in out


def test_a_command_line_that_differs_in_an_input_is_still_refused(tmp_path):
    a = _record(tmp_path / "a", "python train.py --data shard-0")
    b = _record(tmp_path / "b", "python train.py --data shard-1")
    with pytest.raises(IncomparableRunsError, match="config 'command'"):
        samebits.diff(a, b)


@pytest.mark.parametrize("a, b, found", [
    ("python t.py --out runs/a", "python t.py --out runs/b", [("--out", "runs/a", "runs/b")]),
    ("python t.py --output_dir=x/1 --lr 3", "python t.py --output_dir=x/2 --lr 3", [("--output_dir", "x/1", "x/2")]),
    ("torchrun t.py --save-path s1 --log-dir l1", "torchrun t.py --save-path s2 --log-dir l2",
     [("--save-path", "s1", "s2"), ("--log-dir", "l1", "l2")]),
    ("python t.py --save-at 4", "python t.py --save-at 5", None),  # a step, not a folder
    ("python t.py --ckpt-dir a", "python t.py --ckpt-dir a --resume a/4", None),  # another word
    ("python a.py --out x", "python b.py --out y", None),  # another script
    ("python t.py --seed 1 --out x", "python t.py --seed 2 --out y", None),
])
def test_output_paths_only(a, b, found, tmp_path, monkeypatch):
    """Each value that is an output is a folder its run wrote (runs/a, x/1 ...: made here)."""
    monkeypatch.chdir(tmp_path)
    for option, value_a, value_b in found or []:
        for value in (value_a, value_b):
            (tmp_path / value).mkdir(parents=True)
    run_a, run_b = (tmp_path, tmp_path) if found else (None, None)
    assert output_paths_only(a, b, run_a, run_b) == found


def test_a_resumed_run_is_compared_from_its_first_step(runs, capsys):
    """Without --from-step: compared from the step where the resumed run starts; no divergence
    there is INCOMPLETE with the command that decides (steps 0-3 are in one run only), never
    IDENTICAL (a stream that lost its first steps looks the same)."""
    a, _, c = runs
    result = samebits.diff(a, c)
    assert result.verdict is samebits.Verdict.INCOMPLETE and result.compared["steps"] == NUM_STEPS - 4
    assert result.notes[0] == "b starts at step 4 and a at step 0 (b resumed a run?): compared from step 4 on"
    assert result.incomplete == ["no divergence from step 4 on, where b starts (b resumed a run?); the earlier "
                                 "steps are in the other run only. To judge the resume, compare the steps both "
                                 "hold: --from-step 4"]
    assert samebits.diff(c, a).verdict is samebits.Verdict.INCOMPLETE  # either order
    assert main(["diff", str(a), str(c)]) == 2
    assert "--from-step 4" in capsys.readouterr().out


def test_the_documented_resume_diff_is_identical(runs, capsys):
    """docs/resume.md: `samebits diff runs/a runs/c --from-step 4`, C started by another command line."""
    a, _, c = runs
    assert main(["diff", str(a), str(c), "--from-step", "4"]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL" in out
    assert "note: the recorded command lines differ as a resumed run's does" in out


def test_a_resumed_run_that_differs_is_diverged_at_its_step(tmp_path):
    a = _record(tmp_path / "a", "python train.py --ckpt-dir ckpt-a")
    c = _record(tmp_path / "c", "python train.py --ckpt-dir ckpt-c --resume ckpt-a/step-4.pt", first=4, flip_at=5)
    result = samebits.diff(a, c)
    assert result.verdict is samebits.Verdict.DIVERGED and result.first_divergence.step == 5


def test_a_recording_window_is_not_a_resume(tmp_path):
    a = _record(tmp_path / "a", "python train.py")
    windowed = _record(tmp_path / "w", "python train.py", steps="4:")
    result = samebits.diff(a, windowed)
    assert result.verdict is samebits.Verdict.INCOMPLETE  # steps 0-3 were left out on purpose: said, not hidden
    assert not any("resumed" in note for note in result.notes)
