"""Tests of `samebits tax` and of the step times it reads.

The gate logic is tested on synthetic timings (so it can fail: a 10% tax fails a 1.05 gate, a
noisy measurement fails too).  End to end: a command whose deterministic run sleeps twice as
long per step fails the gate; the recipe passes a loose one (a CI smoke test).  Step times
live beside the streams and never make two runs differ.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import pytest
import torch

import samebits
from samebits.cli import main
from samebits.errors import ConfigError, SamebitsError
from samebits.cli._recipe import tax_programs
from samebits.runs.tax import TaxResult, judge, paired_bootstrap, pairs_to_decide, read_step_times, tax
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK, Verdict


def synthetic(ratio: float, noise: float, pairs: int = 6, steps: int = 20, seed: int = 1):
    rng = np.random.default_rng(seed)
    drift = rng.uniform(0.9, 1.1, size=(pairs, 1))  # the machine's speed changes between pairs
    base = 0.1 * drift * rng.lognormal(0, noise, size=(pairs, steps))
    det = 0.1 * drift * ratio * rng.lognormal(0, noise, size=(pairs, steps))
    return det.tolist(), base.tolist()


def test_bootstrap_finds_the_ratio_and_the_gate_judges_its_upper_bound():
    det, base = synthetic(1.10, noise=0.02)
    ratio, (low, high) = paired_bootstrap(det, base)
    assert 1.08 < ratio < 1.12 and low < ratio < high and high < 1.13
    assert judge((low, high), 1.05) is Verdict.FAIL  # a 10% tax fails a 1.05 gate
    assert judge((low, high), 1.15) is Verdict.PASS
    det, base = synthetic(1.00, noise=0.02)
    ratio, ci = paired_bootstrap(det, base)
    assert 0.98 < ratio < 1.02 and judge(ci, 1.05) is Verdict.PASS


def test_a_noisy_measurement_cannot_pass_a_tight_gate_nor_fail_it():
    """An interval that spans the gate is INCONCLUSIVE (INCOMPLETE, exit 2) with how many pairs to add, not FAIL."""
    det, base = synthetic(1.00, noise=0.4, pairs=2, steps=4)
    ratio, ci = paired_bootstrap(det, base)
    assert ci[0] < 1.05 < ci[1] and judge(ci, 1.05) is Verdict.INCOMPLETE
    assert judge((0.844, 1.098), 1.05) is Verdict.INCOMPLETE  # the busy machine of issue 27
    result = TaxResult("out", {}, 2, 0, 1.05, {"deterministic": det, "baseline": base}, ratio, ci, 0.95, 4000, 0)
    assert result.judgement.startswith(f"inconclusive: the 95% CI {ci[0]:.3f}-{ci[1]:.3f} spans the gate 1.050: "
                                       "add pairs (--pairs ")
    assert result.verdict.exit_code == EXIT_CANNOT_RUN
    assert pairs_to_decide(5, 0.954, (0.844, 1.098), 1.05) == 10  # 5 x (0.254 / 0.192)^2 = 8.8: at least twice 5
    assert pairs_to_decide(5, 1.05, (0.9, 1.2), 1.05) == 1000  # a ratio on the gate: no number of pairs is enough


def test_one_estimator_the_ratio_of_the_medians_shown():
    """The headline ratio is the ratio of the two medians the table shows, and the interval is of that
    statistic (issue 27: a headline of 0.941x beside medians of 229 and 160 ms)."""
    det, base = synthetic(1.3, noise=0.3, pairs=4, steps=9, seed=5)
    ratio, ci = paired_bootstrap(det, base)
    assert ratio == pytest.approx(float(np.median(det)) / float(np.median(base)), rel=1e-12)
    assert ci[0] <= ratio <= ci[1]
    result = TaxResult("out", {}, 4, 0, 1.05, {"deterministic": det, "baseline": base}, ratio, ci, 0.95, 4000, 0)
    data = result.to_dict()
    assert data["ratio"] == pytest.approx(data["median_step_s"]["deterministic"] / data["median_step_s"]["baseline"])
    assert data["estimator"] == "ratio of median step times (deterministic / baseline)"
    assert data["verdict"] == "fail" and data["judgement"].startswith("the whole 95% CI")


def test_bootstrap_is_seeded_and_exact_on_a_constant_ratio():
    det, base = synthetic(1.2, noise=0.1)
    assert paired_bootstrap(det, base, seed=3) == paired_bootstrap(det, base, seed=3)
    ratio, ci = paired_bootstrap([[0.2, 0.4]], [[0.1, 0.2]])
    assert ratio == 2.0 and ci == (2.0, 2.0)


@pytest.mark.parametrize("det, base, message", [
    ([], [], "same number"),
    ([[1.0, 2.0]], [[1.0]], "same number"),
    ([[1.0]], [[0.0]], "positive"),
])
def test_bootstrap_rejects_bad_timings(det, base, message):
    with pytest.raises(ConfigError, match=message):
        paired_bootstrap(det, base)


def record(directory, *, rank=0, world_size=1, steps=4, sleep=0.0, first_step=0):
    with samebits.Recorder(directory, rank=rank, world_size=world_size, config={"lr": 0.1}) as rec:
        for step in range(first_step, first_step + steps):
            rec.metrics(step, loss=1.5)
            rec.tensors(step, "params", [("w", torch.arange(6.0))])
            time.sleep(sleep)


def test_step_times_never_make_two_runs_differ(tmp_path):
    record(tmp_path / "fast", steps=4, sleep=0.0)
    record(tmp_path / "slow", steps=4, sleep=0.03)
    fast, slow = read_step_times(tmp_path / "fast"), read_step_times(tmp_path / "slow")
    assert sorted(fast) == sorted(slow) == [0, 1, 2]  # the last step has no successor
    assert min(slow.values()) > 0.025 > max(fast.values())
    assert samebits.diff(tmp_path / "fast", tmp_path / "slow").verdict is Verdict.IDENTICAL
    assert (tmp_path / "slow" / "rank-00000.steptimes").read_text() != (tmp_path / "fast" / "rank-00000.steptimes").read_text()


def test_step_times_reach_the_file_every_64_steps_and_at_close(tmp_path):
    """A step's write stays one system call: step times are written in batches (docs/stream.md)."""
    rec = samebits.Recorder(tmp_path, rank=0, world_size=1)
    path = tmp_path / "rank-00000.steptimes"

    def lines():
        return [line for line in path.read_text().splitlines() if not line.startswith("{")]

    for step in range(70):
        rec.metrics(step, loss=1.0)
        rec.end_step(step)
        if step == 62:
            assert lines() == []  # 63 steps: none written yet
    assert [int(line.split("\t")[0]) for line in lines()] == list(range(64))
    rec.close()
    assert [int(line.split("\t")[0]) for line in lines()] == list(range(70))


def test_step_times_take_the_slowest_rank_and_skip_gaps(tmp_path):
    record(tmp_path / "run", rank=0, world_size=2, steps=3, sleep=0.0)
    record(tmp_path / "run", rank=1, world_size=2, steps=3, sleep=0.03)
    times = read_step_times(tmp_path / "run")
    assert sorted(times) == [0, 1] and min(times.values()) > 0.025
    path = tmp_path / "run" / "rank-00000.steptimes"
    path.write_text(path.read_text() + '{"schema": "samebits.step_times/1"}\n7\t0.0\t0.1\n9\t0.5\t0.6\n')
    assert sorted(read_step_times(tmp_path / "run")) == [0, 1]  # a new segment; 7 -> 9 is a gap
    path.write_text(path.read_text() + "garbage\n")
    with pytest.raises(SamebitsError, match=r"rank-00000.steptimes:\d+: not a step-time line"):
        read_step_times(tmp_path / "run")
    with pytest.raises(SamebitsError, match="no step times"):
        read_step_times(tmp_path)


SLEEPY = """
import sys, time, samebits, torch
deterministic = sys.argv[1] == "1"
rec = samebits.Recorder()                 # SAMEBITS_DIR from samebits tax
for step in range(6):
    rec.metrics(step, loss=1.0)
    time.sleep(0.04 if deterministic else 0.02)
rec.close()
"""


@pytest.mark.slow
def test_gate_fails_a_command_whose_deterministic_run_is_slower(tmp_path, capsys):
    script = tmp_path / "sleepy.py"
    script.write_text(SLEEPY)
    code = main(["tax", "--pairs", "1", "--warmup", "1", "--gate", "1.05", "--json", "--out",
                 str(tmp_path / "out"), "--", sys.executable, str(script), "{deterministic}"])
    data = json.loads(capsys.readouterr().out)
    assert code == EXIT_BAD_VERDICT and data["verdict"] == "fail"
    assert 1.6 < data["ratio"] < 2.4 and data["ci"][1] > 1.05 and data["steps_per_run"] == 4
    assert data["commands"]["deterministic"].endswith(" 1") and data["commands"]["baseline"].endswith(" 0")
    assert (tmp_path / "out" / "tax.json").exists()
    # the two runs record the same records: their timings differ, their streams compare equal
    assert samebits.diff(tmp_path / "out" / "pair-0" / "deterministic", tmp_path / "out" / "pair-0" / "baseline",
                         allow_config_diff=True).verdict is Verdict.IDENTICAL


@pytest.mark.parametrize("argv, message", [
    (["--", "python", "train.py"], "has no {deterministic}"),
    (["--a", "python a.py"], "--a and --b go together"),
    (["--steps", "3", "--warmup", "2"], "needs at least 4 steps"),
    (["--gate", "0"], "positive"),
])
def test_bad_options_exit_2(argv, message, tmp_path, capsys):
    assert main(["tax", "--out", str(tmp_path / "o"), *argv]) == EXIT_CANNOT_RUN
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_recipe_tax_smoke(tmp_path):
    """CI: the recipe with deterministic mode on and off, one pair of 3 steps, a loose gate."""
    result = tax(tmp_path / "out", programs=tax_programs(1, steps=3), pairs=1, warmup=0, gate=100.0)
    assert result.verdict is Verdict.PASS and result.verdict.exit_code == EXIT_OK
    assert 0.2 < result.ratio < 5 and len(result.times["deterministic"][0]) == 2
    assert "deterministic=true" in result.commands["deterministic"]
    assert "deterministic=false" in result.commands["baseline"]
