"""torchtitan's llama3 with samebits' config: the same bits at any data- and tensor-parallel layout (issue 38).

The fast tests hold `verify --across CELLS -- CMD`'s side (cells, the layout variables, the
controls, the resume refusals); the slow ones run torchtitan 0.3.0's own, unmodified entry point
(tests/realcode/torchtitan/launch.py) at three layouts and resume one's checkpoint at the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from samebits.errors import ConfigError
from samebits.runners.across import command_layouts, parse_across, verify_across
from samebits.runners.program import RECORD, ZeroCode

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "tests" / "realcode" / "torchtitan" / "launch.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "{nproc}"]
STEPS, CHECKPOINT = 4, 2
TRAIN = [*TORCHRUN, str(LAUNCH), "--module", "tiny_llama3", "--config", "tiny_invariant", "--dump_folder", "{out}",
         "--training.steps", str(STEPS), "--checkpoint.interval", str(CHECKPOINT)]
RESUME = [*TRAIN, "--checkpoint.initial_load_path", "{from}/checkpoint/step-{step}",
          "--checkpoint.no-initial-load-model-only"]


def test_a_command_takes_layout_cells_and_the_ranks_each_needs():
    assert parse_across("single,fsdp2,fsdp2-tp2,dp2") == [("single", 1), ("fsdp2", 2), ("fsdp2-tp2", 4), ("dp2", 2)]
    assert parse_across("dp=1,2") == [1, 2]  # data-parallel sizes of a command that records itself
    with pytest.raises(ConfigError, match="'fsdp2-x2'"):
        parse_across("single,fsdp2-x2")
    with pytest.raises(ConfigError, match="two distinct"):
        parse_across("fsdp2,fsdp2")


def test_each_cell_runs_under_zero_code_with_its_layout_and_its_control_without_the_invariant_step(tmp_path):
    layouts = command_layouts("single,fsdp2", TRAIN, resume=RESUME)
    assert [(layout.name, layout.nproc) for layout in layouts] == [("single", 1), ("fsdp2", 2)]
    fsdp2 = layouts[1]
    assert isinstance(fsdp2.program, ZeroCode) and isinstance(fsdp2.control, ZeroCode)
    launch = fsdp2.program.launch(RECORD, tmp_path / "fsdp2")
    assert launch.argv[5] == "2"  # {nproc}
    assert launch.env["SAMEBITS_LAYOUT"] == "fsdp2" and launch.env["SAMEBITS_INVARIANT"] == "1"
    assert launch.env["SAMEBITS_DIR"] == str(tmp_path / "fsdp2")
    control = fsdp2.control.launch(RECORD, tmp_path / "control-fsdp2")
    assert control.env["SAMEBITS_LAYOUT"] == "fsdp2" and control.env["SAMEBITS_INVARIANT"] == "0"
    assert fsdp2.program.resume is not None and "2" in fsdp2.program.resume  # {nproc} filled in the resume too


def test_a_command_resumes_across_only_with_its_resume_command_and_step(tmp_path):
    with pytest.raises(ConfigError, match="--resume-with"):
        verify_across(command_layouts("single,fsdp2", TRAIN), tmp_path / "a", resume_across=True, resume_at=2)
    with pytest.raises(ConfigError, match="--resume-at K"):
        verify_across(command_layouts("single,fsdp2", TRAIN, resume=RESUME), tmp_path / "b", resume_across=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before any run or folder
    with pytest.raises(ConfigError, match="records itself has no resume"):
        command_layouts("dp=1,2", TRAIN, resume=RESUME)
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--across", "single,fsdp2", "--resume-with",
                           " ".join(RESUME), "--out", str(tmp_path / "c"), "--", *TRAIN],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "add --resume-across --resume-at K" in proc.stderr
    assert not (tmp_path / "c").exists()


# --- torchtitan itself (the realcode extra; the slow set) --------------------------------------

def _tiny_config(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan", reason="pip install -e '.[realcode]' (CI installs it for the slow set)")
    monkeypatch.setenv("TINY_LLAMA3_ASSETS", str(tmp_path))
    monkeypatch.syspath_prepend(str(LAUNCH.parent))
    from tiny_llama3 import tiny

    config = tiny()
    config.training.global_batch_size = 8
    return config


@pytest.mark.slow
def test_what_the_config_does_not_cover_is_refused_with_its_reason(tmp_path, monkeypatch):
    from samebits.integrations.torchtitan import InvariantTrainer, invariant, refusals, set_layout

    config = _tiny_config(tmp_path, monkeypatch)
    assert refusals(config) == []
    assert isinstance(invariant(config, layout="fsdp2"), InvariantTrainer.Config)
    assert config.parallelism.data_parallel_shard_degree == 2
    monkeypatch.setenv("SAMEBITS_INVARIANT", "0")
    assert not isinstance(invariant(config, layout="single"), InvariantTrainer.Config)  # the control: layout only
    set_layout(config, "fsdp2-tp2")
    assert refusals(config) == []  # tensor parallelism is covered (on the partial_dtensor backend)
    config.training.global_batch_size = -1
    config.debug.seed = None
    config.training.mixed_precision_reduce = "bfloat16"
    config.parallelism.spmd_backend = "spmd_types"
    config.compile.enable_async_tensor_parallel = True
    reasons = "\n".join(refusals(config))
    for named in ("training.global_batch_size", "debug.seed", "mixed_precision_reduce", "spmd_backend 'spmd_types'",
                  "async tensor parallelism"):
        assert named in reasons
    set_layout(config, "dp2-fsdp2")
    assert "HSDP with both replicas (2) and shards (2)" in "\n".join(refusals(config))
    set_layout(config, "dp2-tp2")
    assert not [r for r in refusals(config) if "replica" in r]  # HSDP replicas with TP: covered
    with pytest.raises(ConfigError, match="layout 'fsdp2-ep2'"):
        set_layout(config, "fsdp2-ep2")


@pytest.mark.slow
def test_the_config_gives_the_model_its_tensor_parallel_invariant_layers(tmp_path, monkeypatch):
    from torchtitan.models.common.linear import Linear, ScaledBiasRowwiseLinear

    from samebits.integrations.torchtitan import InvariantLinear, InvariantRMSNorm, invariant, refusals

    config = _tiny_config(tmp_path, monkeypatch)
    model = invariant(config).model_spec.model
    linears = {fqn: cfg for fqn, cfg, _, _ in model.traverse(Linear.Config)}
    assert len(linears) == 2 * 5 + 1 and all(type(cfg) is InvariantLinear.Config for cfg in linears.values())
    assert [fqn for fqn, cfg in linears.items() if cfg.gather_output] == ["lm_head"]  # the loss sees every logit
    norms = [type(cfg) for _, cfg, _, _ in model.traverse(InvariantRMSNorm.Config)]
    assert len(norms) == 2 * 2 + 1
    assert type(invariant(config).model_spec.model.lm_head) is InvariantLinear.Config  # a second call: unchanged
    planted = _tiny_config(tmp_path, monkeypatch)
    w2 = planted.model_spec.model.layers[0].feed_forward.w2
    planted.model_spec.model.layers[0].feed_forward.w2 = ScaledBiasRowwiseLinear.Config(
        in_features=w2.in_features, out_features=w2.out_features)
    with pytest.raises(ConfigError, match="layers.0.feed_forward.w2 is a ScaledBiasRowwiseLinear.Config"):
        invariant(planted)
    biased = _tiny_config(tmp_path, monkeypatch)
    biased.model_spec.model.lm_head.bias = True
    with pytest.raises(ConfigError, match="lm_head is a Linear with a bias"):
        invariant(biased)
    plain = invariant(_tiny_config(tmp_path, monkeypatch), layout="tp2", tensor_parallel=False)  # DP only
    assert not any(plain.model_spec.model.traverse(InvariantLinear.Config))
    assert "tensor parallelism without samebits' invariant layers" in "\n".join(refusals(plain))


@pytest.mark.slow
def test_torchtitan_gives_the_same_bits_at_fsdp2_one_rank_and_tp2_and_resumes_across_them(tmp_path):
    pytest.importorskip("torchtitan", reason="pip install -e '.[realcode]' (CI installs it for the slow set)")
    out = tmp_path / "across"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "samebits", "verify", "--across", "fsdp2,single,tp2",
                           "--resume-across", "--resume-at", str(CHECKPOINT), "--out", str(out), "--json",
                           "--resume-with", " ".join(RESUME), "--", *TRAIN],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["verdict"] == "pass"
    assert result["resume_across"]["step"] == CHECKPOINT and result["resume_across"]["from"] == "fsdp2"
    for layout in ("single", "tp2"):
        check = result["checks"][layout]
        assert check["verdict"] == "identical" and check["by"] == "global" and check["compared"]["steps"] == STEPS
        assert check["counts"]["compared"] > 20 and check["counts"]["missing"] == 0  # params, grads, optimizer state
        resumed = result["resume_across"]["checks"][layout]
        assert resumed["verdict"] == "identical" and resumed["compared"]["steps"] == STEPS - CHECKPOINT
    controls = result["controls"]
    assert len(controls) >= 2 and all(c["differs"] and c["first_step"] == 0 for c in controls)  # it can tell


@pytest.mark.slow
def test_a_run_without_checkpointing_trains_with_the_config(tmp_path):
    pytest.importorskip("torchtitan", reason="pip install -e '.[realcode]' (CI installs it for the slow set)")
    argv = [sys.executable, str(LAUNCH), "--module", "tiny_llama3", "--config", "tiny_invariant", "--dump_folder",
            str(tmp_path / "run"), "--training.steps", "2", "--checkpoint.no-enable"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "SAMEBITS_LAYOUT": "single", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step:  2" in proc.stdout + proc.stderr
