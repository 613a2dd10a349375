"""`diff`'s rule for recorded command lines (issue 34 item 7): two command lines "differ only in
where they write" only when each differing value is a path its run wrote, checked on disk inside
the run's own folder.  An input (a checkpoint to resume or load, a model to start from) or a
setting (a log level, an output activation, a script) is a config difference, refused without
--allow-config-diff.  The 13 command lines the adversarial round passed as output paths are
here, beside the output options that must still compare (each run writing into its own folder).
"""

from __future__ import annotations

import pytest
import torch

import samebits
from samebits.errors import IncomparableRunsError

# (option, a's value, b's value): neither value is a path the run wrote
CONFIG_DIFFERENCES = [
    ("--resume-from-checkpoint", "ckpt/step-100", "ckpt/step-200"),
    ("--resume-from-checkpoint", "{a}/ckpt", "{b}/ckpt"),  # inside the runs, but an input by its name
    ("--load-checkpoint", "ckpt/a.pt", "ckpt/b.pt"),
    ("--load-checkpoint", "{a}/ckpt", "{b}/ckpt"),
    ("--model-checkpoint", "bert-base", "bert-large"),
    ("--init-checkpoint", "init-a.pt", "init-b.pt"),
    ("--init-checkpoint", "{a}/ckpt", "{b}/ckpt"),
    ("--log", "debug", "warning"),
    ("--output", "softmax", "sigmoid"),
    ("--ckpt", "train_a.py", "train_b.py"),  # python --ckpt train_a.py: the script
    ("--save", "best", "last"),
    ("--out", "relu", "gelu"),
    ("--output-dir", "{shared}", "{shared}/../other"),  # a folder outside the runs (written by someone)
]
# the runs' own folders: still "only where they write"
OUTPUTS = [
    ("--out", "{a}", "{b}"),
    ("--ckpt-dir", "{a}/ckpt", "{b}/ckpt"),
    ("--output_dir", "{a}/ckpt", "{b}/ckpt"),
    ("--save-path", "{a}/ckpt/model.pt", "{b}/ckpt/model.pt"),
    ("--log-dir", "{a}/ckpt", "{b}/ckpt"),
]


def _record(path, command: str) -> None:
    with samebits.Recorder(path, rank=0, world_size=1, config={"command": command}) as rec:
        rec.metrics(0, loss=1.0)
        rec.tensors(0, "params", [("w", torch.ones(3))])
        rec.end_step(0)


def _runs(tmp_path, option: str, value_a: str, value_b: str):
    a, b, shared = tmp_path / "a", tmp_path / "b", tmp_path / "shared"
    for folder in (a / "ckpt", b / "ckpt", shared, tmp_path / "other"):
        folder.mkdir(parents=True, exist_ok=True)
    for folder in (a, b):
        (folder / "ckpt" / "model.pt").write_bytes(b"")
    fill = {"a": str(a), "b": str(b), "shared": str(shared)}
    script = "python" if option == "--ckpt" else "python train.py"
    _record(a, f"{script} {option} {value_a.format(**fill)} --lr 0.1")
    _record(b, f"{script} {option} {value_b.format(**fill)} --lr 0.1")
    return a, b


@pytest.mark.parametrize("option, value_a, value_b", CONFIG_DIFFERENCES,
                         ids=[f"{o} {a} {b}" for o, a, b in CONFIG_DIFFERENCES])
def test_an_input_or_a_setting_is_a_config_difference(tmp_path, option, value_a, value_b):
    a, b = _runs(tmp_path, option, value_a, value_b)
    with pytest.raises(IncomparableRunsError, match="config 'command'"):
        samebits.diff(a, b)
    assert samebits.diff(a, b, allow_config_diff=True).verdict is samebits.Verdict.IDENTICAL


@pytest.mark.parametrize("option, value_a, value_b", OUTPUTS, ids=[o for o, _, _ in OUTPUTS])
def test_a_path_each_run_wrote_in_its_own_folder_is_where_it_writes(tmp_path, option, value_a, value_b):
    a, b = _runs(tmp_path, option, value_a, value_b)
    result = samebits.diff(a, b)
    assert result.verdict is samebits.Verdict.IDENTICAL
    assert any(note.startswith(f"the recorded command lines differ only in where they write: {option} ")
               for note in result.notes), result.notes


def test_a_path_the_run_did_not_write_is_not_an_output(tmp_path):
    """The value names the run's folder but nothing is there: not written, so not an output."""
    a, b = _runs(tmp_path, "--ckpt-dir", "{a}/never", "{b}/never")
    with pytest.raises(IncomparableRunsError, match="config 'command'"):
        samebits.diff(a, b)
