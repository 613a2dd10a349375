"""Tests for `samebits check`: output, JSON and exit codes (in-process and one subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from samebits.cli import main
from samebits.determinism import _rules
from samebits.determinism._environment import ENV_SETTINGS

GOOD_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple",
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "FLASH_ATTENTION_DETERMINISTIC": "1",
            "MAMBA_DETERMINISTIC": "1", "CAUSAL_CONV1D_DETERMINISTIC": "1",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "2"}

BAD_TOML = """\
seed = 0
num_threads = 2
moe_combine = "triton_atomic"
moe_grouped_gemm = "torch"
embedding_backward = "dense"
d_model = 64

[ddp]
overlap_grad_reduce = true
"""

EXPECTED_BAD_TABLE = """\
RULE                 SETTING                  FOUND          FIX
-------------------  -----------------------  -------------  ---------------------------------------
config-comm-overlap  ddp.overlap_grad_reduce  true           set ddp.overlap_grad_reduce = false
recipe-moe-combine   moe_combine              triton_atomic  set moe_combine to one of 'index_add',
                                                             'triton_deterministic'
"""


@pytest.fixture
def good_env(monkeypatch):
    for setting in ENV_SETTINGS:
        monkeypatch.setenv(setting.name, GOOD_ENV[setting.name])
    # a GPU machine with every library: every env rule applies, whatever this machine has
    monkeypatch.setattr(_rules, "detect_platform", lambda **_: {feature: True for feature in _rules.FEATURES})
    return monkeypatch


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_clean_config(tmp_path, capsys):
    path = _write(tmp_path, "ok.json", json.dumps({"seed": 1, "num_threads": 1, "moe_combine": "index_add"}))
    assert main(["check", "--config", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"clean: the config {path} pass(es) ")


def test_bad_toml_config_table(tmp_path, capsys):
    path = _write(tmp_path, "bad.toml", BAD_TOML)
    assert main(["check", "--config", path]) == 1
    out = capsys.readouterr().out
    assert out.startswith(EXPECTED_BAD_TABLE)
    assert f"2 violation(s) in the config {path}" in out
    assert "note: 1 config key(s) read by no rule: d_model" in out


def test_json_output(tmp_path, capsys):
    path = _write(tmp_path, "bad.toml", BAD_TOML)
    assert main(["check", "--config", path, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is False
    assert [(v["rule"], v["setting"], v["found"]) for v in data["violations"]] == [
        ("config-comm-overlap", "ddp.overlap_grad_reduce", True),
        ("recipe-moe-combine", "moe_combine", "triton_atomic")]
    assert all(v["fix"] for v in data["violations"])
    assert data["unchecked_keys"] == ["d_model"]


def test_ignore_waives_a_rule(tmp_path, capsys):
    path = _write(tmp_path, "bad.toml", BAD_TOML)
    assert main(["check", "--config", path, "--ignore", "config-comm-overlap",
                 "--ignore", "recipe-moe-combine"]) == 0
    assert main(["check", "--config", path, "--ignore", "no-such-rule"]) == 2
    assert "--ignore: cannot ignore unknown rule id(s) ['no-such-rule']" in capsys.readouterr().err


def test_env_check(good_env, capsys):
    assert main(["check", "--env"]) == 0
    assert main(["check"]) == 0  # without --config: the environment
    good_env.setenv("NCCL_ALGO", "Tree")
    good_env.delenv("NCCL_PROTO")
    assert main(["check", "--env", "--json"]) == 1
    capsys.readouterr()
    assert main(["check"]) == 1
    out = capsys.readouterr().out
    assert "env-nccl-algo" in out and "Tree" in out and "<unset>" in out
    assert "2 violation(s) in the environment" in out


def test_config_and_env_together(good_env, tmp_path, capsys):
    path = _write(tmp_path, "bad.toml", BAD_TOML)
    good_env.setenv("NCCL_PROTO", "^LL")
    assert main(["check", "--config", path, "--env", "--json"]) == 1
    rules = [v["rule"] for v in json.loads(capsys.readouterr().out)["violations"]]
    assert rules == ["env-nccl-proto", "config-comm-overlap", "recipe-moe-combine"]


@pytest.mark.parametrize("name,text,message", [
    ("missing.json", None, "cannot read it: No such file or directory"),
    ("broken.json", '{"seed": 1,', "invalid JSON at line 1, column 12"),
    ("broken.toml", "seed = = 1", "invalid TOML"),
    ("list.json", "[1, 2]", "must hold an object of options at top level, found a list"),
    ("config.yaml", "seed: 1", "unsupported format '.yaml'; use a .json or .toml file"),
])
def test_bad_input_exits_2_with_a_clear_message(tmp_path, capsys, name, text, message):
    path = str(tmp_path / name) if text is None else _write(tmp_path, name, text)
    assert main(["check", "--config", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"samebits check: error: --config {path}: ") and message in err


def test_near_miss_key_warns(tmp_path, capsys):
    path = _write(tmp_path, "typo.json", json.dumps({"moe_combin": "triton_atomic"}))
    assert main(["check", "--config", path]) == 2  # its only key is misspelt: nothing was checked
    err = capsys.readouterr().err
    assert "warning: config key 'moe_combin' is read by no rule; did you mean 'moe_combine'?" in err


def test_list_rules(capsys):
    assert main(["check", "--list-rules", "--json"]) == 0
    ids = [r["id"] for r in json.loads(capsys.readouterr().out)["rules"]]
    assert "recipe-moe-combine" in ids and "env-nccl-algo" in ids and len(ids) == len(set(ids))


def test_real_subprocess(tmp_path):
    path = _write(tmp_path, "bad.toml", BAD_TOML)
    done = subprocess.run([sys.executable, "-m", "samebits", "check", "--config", path, "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["violations"][1]["rule"] == "recipe-moe-combine"


def test_env_check_on_a_cpu_only_torch(monkeypatch, capsys):
    for setting in ENV_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setattr(_rules, "detect_platform", lambda **_: {feature: False for feature in _rules.FEATURES})
    assert main(["check", "--env", "--json"]) == 0  # unset thread count and hash seed: advice (issue 35 item 9)
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is True and data["violations"] == []
    assert sorted(a["rule"] for a in data["advice"]) == ["env-omp-threads", "env-pythonhashseed"]
    assert "env-cublas-workspace" in data["not_applicable"] and "env-nccl-algo" in data["not_applicable"]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert main(["check", "--env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("clean: the environment pass(es) 2 determinism rules\n") and "advice" not in out
    assert "not applicable on this machine (7 rule(s)): " in out and "without CUDA" in out


def test_settings_that_cannot_change_this_machines_bits_are_advice_not_violations(monkeypatch, capsys):
    """Issue 35 item 9: `check --env` exited 1 for PYTHONHASHSEED and OMP_NUM_THREADS unset on a
    host whose runs were bitwise identical.  Unset, every run here uses the same thread count,
    and a random str hash matters only where a set's order decides something: advice, exit 0,
    with the cases in which they would matter.  A value that is wrong stays a violation."""
    for setting in ENV_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setattr(_rules, "detect_platform", lambda **_: {feature: False for feature in _rules.FEATURES})
    monkeypatch.setenv("PYTHONHASHSEED", "random")  # the same as unset
    assert main(["check", "--env"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("clean: the environment pass(es) 2 determinism rules, with 2 piece(s) of advice below")
    assert "violation" not in out.split("advice (not violations")[0]
    assert "env-omp-threads: OMP_NUM_THREADS=<unset>: torch uses its default thread count (" in out
    assert "the bits change only if the count differs between runs" in out
    assert "env-pythonhashseed: PYTHONHASHSEED=random: " in out and "iteration order of a set" in out
    # wrong values change what runs: Python refuses PYTHONHASHSEED=abc, libgomp ignores OMP_NUM_THREADS=auto
    monkeypatch.setenv("PYTHONHASHSEED", "abc")
    monkeypatch.setenv("OMP_NUM_THREADS", "auto")
    assert main(["check", "--env", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert sorted(v["rule"] for v in data["violations"]) == ["env-omp-threads", "env-pythonhashseed"]
    assert data["advice"] == [] and data["clean"] is False


def test_a_config_that_pins_the_thread_count_needs_no_omp_advice(monkeypatch, tmp_path, capsys):
    for setting in ENV_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setattr(_rules, "detect_platform", lambda **_: {feature: False for feature in _rules.FEATURES})
    path = _write(tmp_path, "train.json", json.dumps({"train": {"num_threads": 4}, "seed": 0}))
    assert main(["check", "--config", path, "--env", "--json"]) == 0
    assert [a["rule"] for a in json.loads(capsys.readouterr().out)["advice"]] == ["env-pythonhashseed"]
    path = _write(tmp_path, "unpinned.json", json.dumps({"num_threads": 0, "seed": 0}))
    assert main(["check", "--config", path, "--env", "--json"]) == 1  # config-num-threads: 0 is no pin
    data = json.loads(capsys.readouterr().out)
    assert [v["rule"] for v in data["violations"]] == ["config-num-threads"]
    assert sorted(a["rule"] for a in data["advice"]) == ["env-omp-threads", "env-pythonhashseed"]


@pytest.mark.parametrize("text", [json.dumps({"model": {"hidden": 4096}, "lr": 3e-4}), "{}"])
def test_a_config_no_rule_can_read_is_not_called_clean(tmp_path, capsys, text):
    path = _write(tmp_path, "other.json", text)
    assert main(["check", "--config", path]) == 2
    out = capsys.readouterr().out
    assert "clean" not in out
    assert f"config {path} read as JSON: no key any rule reads" in out
    assert f"not checked: samebits could not interpret {path}" in out
    assert main(["check", "--config", path, "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["clean"] is False and data["checked_keys"] == [] and data["config_format"] == "JSON"


def test_config_check_names_the_keys_it_read(tmp_path, capsys):
    path = _write(tmp_path, "ok.toml", "lr = 1\n[train]\nnum_threads = 4\n")
    assert main(["check", "--config", path]) == 0
    out = capsys.readouterr().out
    assert f"config {path} read as TOML: 1 key(s) checked: num_threads" in out


def test_a_cuda_build_of_torch_on_a_machine_without_a_gpu_has_no_cuda_violations(monkeypatch, capsys):
    """The default torch wheel on Linux is built with CUDA; on a machine with no GPU its runs use no
    cuBLAS nor NCCL, so CUBLAS_WORKSPACE_CONFIG and NCCL_* cannot change their bits: not applicable
    (the CLI counts the GPUs; a library check() inside a training process does not)."""
    import torch
    import torch.distributed as dist

    for setting in ENV_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert main(["check", "--env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["violations"] == [] and data["clean"] is True
    for rule_id in ("env-cublas-workspace", "env-nccl-algo", "env-nccl-proto"):
        assert data["not_applicable"][rule_id].startswith("no GPU is visible on this machine")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU: the CUDA settings decide bits
    assert main(["check", "--env", "--json"]) == 1
    violated = {v["rule"] for v in json.loads(capsys.readouterr().out)["violations"]}
    assert {"env-cublas-workspace", "env-nccl-algo", "env-nccl-proto"} <= violated

