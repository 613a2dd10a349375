"""Choosing what to record: include/exclude globs, phases, the shared CLI options, `show --records`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import samebits
from samebits.autorecord import recording_variables
from samebits.settings import REGISTRY, RecordingSpec
from samebits.cli import main
from samebits.stream import catalogue
from samebits.stream.reader import open_run
from samebits.verdicts import Verdict


def _record(path, **choices):
    rec = samebits.Recorder(path, rank=0, world_size=1, **choices)
    for step in range(2):
        rec.metrics(step, loss=1.5)
        rec.tensors(step, "params", {"layer.weight": torch.ones(2, 3), "layer.bias": torch.zeros(3),
                                     "router.weight": torch.ones(4)})
        rec.tensors(step, "optimizer", {"layer.weight.exp_avg": torch.ones(2, 3)})
        rec.end_step(step)
    rec.close()


def _names(path):
    return [(e.phase, e.name) for e in catalogue(path)[2]]


def test_include_and_exclude_choose_tensors_by_phase_and_name(tmp_path):
    _record(tmp_path / "all")
    _record(tmp_path / "some", include=["params/*"], exclude=["*.bias"])
    _record(tmp_path / "router", include="*router*")
    assert len(_names(tmp_path / "all")) == 5
    assert _names(tmp_path / "some") == [("metrics", "loss"), ("params", "layer.weight"), ("params", "router.weight")]
    assert ("params", "router.weight") in _names(tmp_path / "router")
    assert ("params", "layer.weight") not in _names(tmp_path / "router")
    summary = samebits.stream.summarise(tmp_path / "some")
    assert summary["selection"]["include"] == ["params/*"] and summary["selection"]["exclude"] == ["*.bias"]


def test_the_environment_chooses_too(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_EXCLUDE", "optimizer/*,params/router.*")
    _record(tmp_path / "env")
    assert ("optimizer", "layer.weight.exp_avg") not in _names(tmp_path / "env")
    assert ("params", "router.weight") not in _names(tmp_path / "env")
    assert ("params", "layer.bias") in _names(tmp_path / "env")


def test_runs_whose_steps_hold_no_records_are_never_identical(tmp_path):
    """Everything filtered out: equal roots of empty steps prove nothing."""
    _record(tmp_path / "a", include=["nothing/*"], phases=["params"])
    _record(tmp_path / "b", include=["nothing/*"], phases=["params"])
    result = samebits.diff(tmp_path / "a", tmp_path / "b")
    assert result.verdict is Verdict.INCOMPLETE and "hold no records" in result.incomplete[0]


def test_bad_choices_are_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(samebits.ConfigError, match="SAMEBITS_RANKS"):
        recording_variables(ranks="zero")
    with pytest.raises(SystemExit) as exit_info:  # refused as the options are parsed
        main(["run", "--out", str(tmp_path / "r"), "--ranks", "x-", "--", sys.executable, "-c", "print(1)"])
    assert exit_info.value.code == 2 and "--ranks='x-' is not a rank list" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


SCRIPT = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
    opt.step(); opt.zero_grad()
"""


def test_run_options_reach_zero_code_recording_and_show_lists_them(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    code = main(["run", "--out", str(out), "--phases", "params,grads", "--include", "*weight",
                 "--record-steps", "1:3", "--", sys.executable, str(script)])
    assert code == 0
    capsys.readouterr()
    assert main(["show", str(out), "--records", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 1
    assert sorted((r["phase"], r["name"]) for r in shown["records"]) == [
        ("grads", "0.weight"), ("grads", "1.weight"), ("params", "0.weight"), ("params", "1.weight")]
    assert main(["show", str(out), "--records", "--step", "2"]) == 0
    text = capsys.readouterr().out
    assert "rank 0, step 2: 4 name(s) in 2 phase(s)" in text and "0.weight" in text
    assert main(["show", str(out), "--records", "--step", "0"]) == 2  # outside the recorded window
    assert "has no step 0" in capsys.readouterr().err


def test_wants_says_what_would_be_written(tmp_path):
    """`wants` matches what `tensors` keeps: phases and the step window filter, a disabled
    recorder or an unrecorded rank wants nothing."""
    rec = samebits.Recorder(tmp_path / "a", rank=0, world_size=1, phases="grads,params", steps="2:4")
    asked = {(step, phase): rec.wants(step, phase) for step in range(5) for phase in ("params", "state")}
    for step in range(5):
        for phase in ("params", "state"):
            rec.tensors(step, phase, {"w": torch.ones(2)})
    rec.close()
    reader = open_run(tmp_path / "a").stream(0)
    written = {(block.step, record.phase) for block in reader.steps() for record in block.records()}
    reader.close()
    assert {key for key, wanted in asked.items() if wanted} == written == {(2, "params"), (3, "params")}
    assert not samebits.Recorder(tmp_path / "b", rank=0, world_size=1, enabled=False).wants(0, "params")
    assert not samebits.Recorder(tmp_path / "c", rank=1, world_size=2, ranks="0").wants(0, "params")


# -- RecordingSpec: what to record, declared once -------------------------------------------


def test_the_spec_is_the_one_declaration_of_the_variables_and_the_options():
    """Each field's variable is in the registry with the spec's type, doc and default, and each
    field is an option of `samebits run` and `verify` with the spec's help."""
    import argparse

    for name, option in RecordingSpec.options().items():
        setting = REGISTRY[option.env]
        assert (setting.type, setting.doc, setting.default) == (option.type, option.doc, getattr(RecordingSpec(), name))
    parser = argparse.ArgumentParser()
    RecordingSpec.add_to_argparse(parser, flags={"steps": "--window"})
    flags = {action.dest: action for action in parser._actions}
    assert sorted(flags) == sorted(["help"] + [f"record_{name}" for name in RecordingSpec.options()])
    assert flags["record_steps"].option_strings == ["--window"]  # renamed where a command needs it
    assert flags["record_ranks"].option_strings == ["--ranks"]
    assert flags["record_ranks"].help == "record only these ranks, e.g. 0,2,4-7"


WHAT = {"steps": "3:9", "ranks": "0,2-3", "phases": "params,grads", "include": "params/*,*.router.*",
        "exclude": "optimizer/*", "max_tensor_bytes": "4096"}


def test_the_spec_reads_and_writes_the_environment_and_the_options_the_same_way():
    import argparse

    spec = RecordingSpec(**WHAT)
    assert spec == RecordingSpec(steps=range(3, 9), ranks=[3, 2, 0], phases={"grads", "params"},
                                 include=["params/*", "*.router.*"], exclude=("optimizer/*",), max_tensor_bytes=4096)
    assert spec.steps == (3, 9) and spec.ranks == frozenset({0, 2, 3}) and spec.max_tensor_bytes == 4096
    env = spec.to_env()
    assert env == {"SAMEBITS_STEPS": "3:9", "SAMEBITS_RANKS": "0,2,3", "SAMEBITS_PHASES": "grads,params",
                   "SAMEBITS_INCLUDE": "params/*,*.router.*", "SAMEBITS_EXCLUDE": "optimizer/*",
                   "SAMEBITS_MAX_TENSOR_BYTES": "4096"}
    assert RecordingSpec.from_env(env) == spec
    assert RecordingSpec().to_env() == dict.fromkeys(env)  # the defaults: every variable unset
    assert RecordingSpec.from_env({}) == RecordingSpec() and RecordingSpec(steps="5:").to_env()["SAMEBITS_STEPS"] == "5:"
    parser = argparse.ArgumentParser()
    RecordingSpec.add_to_argparse(parser)
    args = parser.parse_args(["--record-steps", "3:9", "--ranks", "0,2-3", "--phases", "params,grads", "--include",
                              "params/*", "--include", "*.router.*", "--exclude", "optimizer/*",
                              "--max-tensor-bytes", "4096"])
    assert RecordingSpec.from_args(args) == spec
    assert RecordingSpec.from_args(parser.parse_args([])) == RecordingSpec()


def test_a_bad_value_names_where_it_came_from(capsys):
    import argparse

    with pytest.raises(samebits.ConfigError, match=r"^ranks='x' is not a rank list"):
        RecordingSpec(ranks="x")
    with pytest.raises(samebits.ConfigError, match=r"^SAMEBITS_STEPS='9:3' is an empty"):
        RecordingSpec.from_env({"SAMEBITS_STEPS": "9:3"})
    with pytest.raises(samebits.ConfigError, match=r"^SAMEBITS_MAX_TENSOR_BYTES=0: the size cap is a positive"):
        recording_variables(max_tensor_bytes=0)
    with pytest.raises(samebits.ConfigError, match=r"recording_variables: stepz is not something to record"):
        recording_variables(stepz="1:2")
    with pytest.raises(samebits.ConfigError, match="an empty selection"):
        RecordingSpec(ranks=[]).to_env()  # an empty SAMEBITS_RANKS would record every rank
    parser = argparse.ArgumentParser(prog="p")
    RecordingSpec.add_to_argparse(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-tensor-bytes", "-5"])
    assert "argument --max-tensor-bytes: --max-tensor-bytes=-5: the size cap" in capsys.readouterr().err


def test_recording_variables_start_from_a_spec():
    spec = RecordingSpec(**WHAT)
    assert recording_variables(spec=spec) == spec.to_env()
    assert recording_variables(spec=spec, steps="1:")["SAMEBITS_STEPS"] == "1:"  # a keyword replaces the field
    assert recording_variables() == RecordingSpec().to_env()


def test_the_recorder_takes_a_spec_over_the_environment_and_keywords_over_the_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("SAMEBITS_PHASES", "optimizer")
    assert samebits.Recorder(tmp_path / "env", rank=0, world_size=1).settings.phases == frozenset({"optimizer"})
    spec = RecordingSpec(phases="params", steps="1:")
    rec = samebits.Recorder(tmp_path / "spec", rank=0, world_size=1, spec=spec)
    assert rec.settings.spec == spec and rec.settings.phases == frozenset({"params"}) and rec.settings.step_start == 1
    rec = samebits.Recorder(tmp_path / "both", rank=0, world_size=1, spec=spec, phases="grads")
    assert rec.settings.phases == frozenset({"grads"}) and rec.settings.step_start == 1
    with pytest.raises(samebits.ConfigError, match="pass a samebits.RecordingSpec"):
        samebits.Recorder(tmp_path / "bad", rank=0, world_size=1, spec={"phases": "params"})
