"""`samebits replay`: a DP=4 run's steps (tests/test_invariant.py's) re-executed on 1 rank from its checkpoint give the
recorded bits (invariant reduction); a replay that computes differently is caught at its
first step; a run not recorded in invariant mode is refused."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.cli._recipe import replay_config_at
from samebits.errors import ConfigError
from samebits.runners.across import compare_replicated
from samebits.runners.replay import replay
from samebits.verdicts import Verdict
from test_invariant import invariant_runs  # noqa: F401  (the shared DP=1/2/4 runs)

SCRIPT = Path(__file__).parent / "scripts_invariant" / "train_dp.py"
REPLAY = [sys.executable, str(SCRIPT), "--resume-from", "{ckpt}", "--first-step", "{step}", "--steps", "{stop}",
          "--out", "{out}"]


@pytest.fixture
def dp4_run(invariant_runs):
    """tests/test_invariant.py's run at DP=4 (20 steps, invariant mode, state saved before each step)."""
    return Path(invariant_runs.out) / "dp4"


@pytest.mark.slow
def test_a_dp4_step_replays_bit_identically_on_one_rank(dp4_run, tmp_path, capsys):
    code = main(["replay", str(dp4_run), "--step", "5", "--num-steps", "2", "--nproc", "1", "--out",
                 str(tmp_path / "r"), "--with", " ".join(REPLAY)])
    shown = capsys.readouterr().out
    assert code == 0, shown
    assert "IDENTICAL" in shown and "recorded on 4 ranks, replayed on 1" in shown
    check = compare_replicated(dp4_run, tmp_path / "r" / "replay", start_step=5, stop_step=7)
    assert check.compared["steps"] == 2 and check.compared["records"] == 2 * 13


@pytest.mark.slow
def test_a_replay_that_reduces_differently_is_caught_at_its_first_step(dp4_run, tmp_path):
    result = replay(dp4_run, step=3, nproc=1, num_steps=2, cmd=REPLAY + ["--grad-reduce", "mean"], out=tmp_path / "r")
    assert result.verdict is Verdict.DIVERGED
    assert result.check.first_divergence.step == 3


def test_a_run_not_recorded_in_invariant_mode_is_refused(tmp_path):
    with samebits.Recorder(tmp_path / "plain", rank=0, world_size=1, config={"grad_reduce": "mean"}) as rec:
        rec.metrics(0, loss=1.0)
        rec.end_step(0)
    with pytest.raises(ConfigError, match="not recorded in invariant mode"):
        replay(tmp_path / "plain", step=0, cmd=["true"], out=tmp_path / "out")
    assert main(["replay", str(tmp_path / "plain"), "--step", "0", "--with", "true"]) == 2


def test_the_recipe_replays_at_another_rank_count_with_the_layout_of_n_ranks():
    """`replay --nproc N` on the recipe: the run's recorded config, then (at another rank count
    than the run's) the sizes of N data-parallel ranks and --allow-layout-change; at its own
    rank count, the config as recorded."""
    config = {"grad_reduce": "invariant", "tp_reduce": "invariant", "dp_replicate": 2, "tp": 2, "seed": 3,
              "parallel": {"cell": "tp2-dp2", "mesh": {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "tp": 2, "ep": 1}}}
    recorded = ["--set", "dp_replicate=2", "--set", "grad_reduce=invariant", "--set", "seed=3", "--set", "tp=2",
                "--set", "tp_reduce=invariant"]
    assert replay_config_at(4)(config) == recorded
    assert replay_config_at(1)(config) == recorded + ["--set", "pp=1", "--set", "dp_replicate=1", "--set", "dp_shard=1",
                                                      "--set", "tp=1", "--set", "ep=1", "--allow-layout-change"]
    assert replay_config_at(2)(config) == recorded + ["--set", "pp=1", "--set", "dp_replicate=2", "--set", "dp_shard=1",
                                                      "--set", "tp=1", "--set", "ep=1", "--allow-layout-change"]
    assert replay_config_at(2)({"grad_reduce": "invariant"}) == ["--set", "grad_reduce=invariant"]  # no mesh: as is


@pytest.mark.slow
def test_a_recipe_step_replays_at_another_rank_count(tmp_path, capsys):
    """A dp2 run of `verify --across` replays its step 1 on one rank, and the one-rank run on
    two, from their own checkpoints (--allow-layout-change): the same records."""
    out = tmp_path / "across"
    assert main(["verify", "--across", "single,dp2", "--steps", "2", "--no-controls", "--out", str(out),
                 "--set", "num_layers=2", "--set", "seq_len=32"]) == 0
    capsys.readouterr()
    for run, nproc in (("dp2", 1), ("single", 2)):
        code = main(["replay", str(out / run), "--step", "1", "--nproc", str(nproc), "--out",
                     str(tmp_path / f"replay-{run}"), "--json"])
        shown = json.loads(capsys.readouterr().out)
        assert code == 0 and shown["verdict"] == "identical", shown
        assert (shown["recorded_world_size"], shown["nproc"]) == (3 - nproc, nproc)
        assert shown["check"]["compared"]["steps"] == 1 and shown["check"]["compared"]["records"] > 0
        assert "--allow-layout-change" in shown["runs"][0]["command"]


def test_a_step_the_run_did_not_record_is_refused(tmp_path):
    with samebits.Recorder(tmp_path / "inv", rank=0, world_size=1, config={"grad_reduce": "invariant"}) as rec:
        rec.metrics(0, loss=1.0)
        rec.end_step(0)
    with pytest.raises(ConfigError, match="holds no record of step 1"):
        replay(tmp_path / "inv", step=0, num_steps=2, cmd=["true"], out=tmp_path / "out")


def _record(path, world_size, steps, *, flip_at=None, shard=False):
    """Rank 0 of a run: replicated params each step (one flipped at ``flip_at``), and a
    rank-local shard record when ``shard``."""
    with samebits.Recorder(path, rank=0, world_size=world_size, config={"grad_reduce": "invariant"}) as rec:
        for step in steps:
            weight = torch.full((3, 4), float(step))
            if step == flip_at:
                weight[1, 2] = torch.nextafter(weight[1, 2], torch.tensor(1e9))
            rec.tensors(step, "params", [("w", weight)])
            if shard:
                rec.tensors(step, "params", [(f"expert.shard{world_size}", weight[:1])])
            rec.end_step(step)


def test_compare_replicated_finds_the_first_differing_step_across_world_sizes(tmp_path):
    _record(tmp_path / "a", 4, range(5), shard=True)
    _record(tmp_path / "b", 1, range(5), flip_at=3, shard=True)
    check = compare_replicated(tmp_path / "a", tmp_path / "b")
    assert check.verdict is Verdict.DIVERGED
    assert (check.first_divergence.step, check.first_divergence.name) == (3, "w")
    assert check.compared["steps"] == 4 and check.compared["records"] == 4  # shards not counted
    assert any("only in" in note for note in check.notes)


def test_compare_replicated_is_incomplete_when_a_step_is_missing_or_nothing_compares(tmp_path):
    _record(tmp_path / "a", 2, range(4))
    _record(tmp_path / "b", 1, range(2))
    assert compare_replicated(tmp_path / "a", tmp_path / "b").verdict is Verdict.INCOMPLETE
    assert compare_replicated(tmp_path / "a", tmp_path / "b", stop_step=2).verdict is Verdict.IDENTICAL
    assert compare_replicated(tmp_path / "a", tmp_path / "b", start_step=9).verdict is Verdict.INCOMPLETE


def test_verify_across_refuses_bad_sizes_and_a_command_without_placeholders(capsys):
    assert main(["verify", "--across", "dp=1"]) == 2
    assert main(["verify", "--across", "xp=1,2"]) == 2
    assert main(["verify", "--across", "dp=1,2", "--", "python", "train.py"]) == 2
    assert "{nproc} and {out}" in capsys.readouterr().err
