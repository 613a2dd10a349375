"""Tests of `samebits tax` and of the step times it reads.

The statistics are tested on synthetic timings, deterministic and fast: a 10% tax fails a 1.05
gate, steps count as samples only when the pairs agree (the interval keeps its coverage when
runs have their own speed or steps follow each other), pairs are added until the interval
decides or the budget ends, and the advice comes from the spread seen.  End to end: a command whose deterministic run sleeps twice as
long per step fails the gate; the recipe passes a loose one (a CI smoke test).  Step times
live beside the streams and never make two runs differ.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time

import numpy as np
import pytest
import torch

import samebits
from samebits.cli import main
from samebits.errors import ConfigError, SamebitsError
from samebits.cli._recipe import tax_programs
from samebits.runners.tax import (POOL_ALPHA, TaxResult, estimate, f_sf, judge, look_confidence, measure, pairs_to_decide,
                                read_step_times, t_quantile, tax)
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK, Verdict


def synthetic(ratio: float, noise: float, pairs: int = 6, steps: int = 20, seed: int = 1, run_sd: float = 0.0,
              rho: float = 0.0):
    """Per-step seconds of ``pairs`` pairs: lognormal step noise (AR(1) with ``rho`` within a run),
    a per-run speed factor of spread ``run_sd``, and a machine speed that drifts between pairs."""
    rng = np.random.default_rng(seed)
    drift = rng.uniform(0.8, 1.2, size=pairs)  # the machine's speed changes between pairs

    def run(scale):
        noise_path = np.empty(steps)
        noise_path[0] = rng.normal(0, noise)
        for s in range(1, steps):
            noise_path[s] = rho * noise_path[s - 1] + np.sqrt(1 - rho ** 2) * rng.normal(0, noise)
        return (0.04 * scale * np.exp(rng.normal(0, run_sd) + noise_path)).tolist()

    return [run(d * ratio) for d in drift], [run(d) for d in drift]


def test_estimate_finds_the_ratio_and_the_gate_judges_its_upper_bound():
    det, base = synthetic(1.10, noise=0.02)
    est = estimate(det, base)
    assert 1.08 < est.ratio < 1.12 and est.ci[0] < est.ratio < est.ci[1] < 1.13
    assert judge(est.ci, 1.05) is Verdict.FAIL  # a 10% tax fails a 1.05 gate
    assert judge(est.ci, 1.15) is Verdict.PASS
    est = estimate(*synthetic(1.00, noise=0.02))
    assert 0.98 < est.ratio < 1.02 and judge(est.ci, 1.05) is Verdict.PASS


def test_steps_count_as_samples_when_the_pairs_agree_and_then_four_pairs_decide():
    """Issue 35 item 10: on a quiet host (no run-level effect, independent steps) the steps are the
    samples, and 4 pairs of 27 steps with 10% step noise decide a 1.05 gate; the pairs alone
    (t with 3 degrees of freedom) could not."""
    det, base = synthetic(1.0, noise=0.10, pairs=4, steps=27, seed=3)
    est = estimate(det, base, confidence=look_confidence(0.95, 1, adaptive=True))
    assert est.unit == "steps" and est.pooling_p > POOL_ALPHA and est.df == 3 + 4 * (17 - 1)  # 27 steps, 5 trimmed each end
    assert judge(est.ci, 1.05) is Verdict.PASS
    blocks_only = estimate(det, base, confidence=est.confidence, pool_alpha=1.0)  # never pool
    assert blocks_only.unit == "pairs" and blocks_only.df == 3
    assert judge(blocks_only.ci, 1.05) is Verdict.INCOMPLETE


@pytest.mark.parametrize("case", [dict(run_sd=0.05), dict(rho=0.8)])
def test_pairs_are_the_samples_when_the_steps_of_one_run_share_something(case):
    """A per-run speed, or steps that follow each other (AR(1)), make the pairs differ more than
    their step noise predicts: the interval is then a t interval on the pairs' block estimates."""
    est = estimate(*synthetic(1.0, noise=0.05, pairs=8, steps=27, seed=4, **case))
    assert est.unit == "pairs" and est.df == 7 and est.pooling_p <= POOL_ALPHA


def test_the_interval_keeps_its_coverage_whatever_the_steps_share():
    """The soundness of counting steps: over many synthetic measurements with a true ratio of 1,
    the 95% interval covers 1 about 95% of the time with or without run-level effects; an interval
    that always counted steps as samples (the pooled one, forced) covers far less with them."""
    def coverage(pool_alpha, **case):
        hits = 0
        for seed in range(150):
            ci = estimate(*synthetic(1.0, noise=0.08, pairs=6, steps=20, seed=seed, **case), pool_alpha=pool_alpha).ci
            hits += ci[0] <= 1.0 <= ci[1]
        return hits / 150

    assert coverage(POOL_ALPHA) >= 0.9  # independent steps
    assert coverage(POOL_ALPHA, run_sd=0.04) >= 0.9
    assert coverage(POOL_ALPHA, rho=0.6) >= 0.88
    assert coverage(0.0, run_sd=0.04) < 0.75  # steps always pooled: overconfident


def test_one_estimator_the_ratio_of_the_typical_steps_shown():
    """The headline ratio is the quotient of the two typical step times the table shows (issue 27:
    a headline of 0.941x beside medians of 229 and 160 ms), and a step slowed on one side only is
    trimmed rather than averaged in."""
    det, base = synthetic(1.3, noise=0.05, pairs=4, steps=10, seed=5)
    det[2][4] *= 20  # another process took the CPU during one step of one run
    est = estimate(det, base)
    assert est.ratio == pytest.approx(est.typical_step_s["deterministic"] / est.typical_step_s["baseline"], rel=1e-12)
    assert 1.25 < est.ratio < 1.35 and est.ci[0] <= est.ratio <= est.ci[1] and est.steps_kept == 6
    result = TaxResult("out", {}, 0, 1.05, {"deterministic": det, "baseline": base}, est, 0.95)
    data = result.to_dict()
    assert data["ratio"] == pytest.approx(data["typical_step_s"]["deterministic"] / data["typical_step_s"]["baseline"])
    assert data["estimator"].startswith("geometric mean of paired step-time ratios")
    assert data["verdict"] == "fail" and data["judgement"].startswith("the whole 95% CI")


def test_estimate_is_exact_on_a_constant_ratio():
    est = estimate([[0.2, 0.4, 0.3]], [[0.1, 0.2, 0.15]])
    assert est.ratio == pytest.approx(2.0) and est.ci == pytest.approx((2.0, 2.0))


@pytest.mark.parametrize("det, base, message", [
    ([], [], "same number"),
    ([[1.0, 2.0]], [[1.0]], "same number"),
    ([[1.0]], [[0.0]], "positive"),
])
def test_estimate_rejects_bad_timings(det, base, message):
    with pytest.raises(ConfigError, match=message):
        estimate(det, base)


def test_t_and_f_distributions_match_published_tables():
    # Student t and F critical values (any statistics table, e.g. NIST/SEMATECH e-Handbook 1.3.6.7)
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-4)
    assert t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-4)
    assert t_quantile(0.995, 30) == pytest.approx(2.7500, abs=1e-4)
    assert t_quantile(0.975, 1e9) == pytest.approx(1.95996, abs=1e-5)
    assert f_sf(3.3258, 5, 10) == pytest.approx(0.05, abs=1e-5)  # F(0.95; 5, 10) = 3.3258
    assert f_sf(2.8661, 4, 20) == pytest.approx(0.05, abs=1e-5)
    assert f_sf(1.3909, 3, 100) == pytest.approx(0.25, abs=1e-5)
    assert f_sf(0.0, 3, 100) == 1.0 and f_sf(math.inf, 3, 100) == 0.0


class FakeHost:
    """`measure`'s runs and clock, without running anything: each pair takes ``pair_s`` seconds
    and gives synthetic step times (the same generator as above, one pair at a time)."""

    def __init__(self, ratio, noise, pair_s=9.0, run_sd=0.0, steps=27):
        self.now, self.pair_s, self.ran = 0.0, pair_s, 0
        self.det, self.base = synthetic(ratio, noise=noise, pairs=400, steps=steps, seed=7, run_sd=run_sd)

    def clock(self):
        return self.now

    def run_pair(self, pair):
        self.now += self.pair_s
        self.ran += 1
        return self.det[pair], self.base[pair]


def test_a_quiet_host_decides_at_the_first_look():
    host = FakeHost(1.0, noise=0.05)
    times, est, looks, elapsed = measure(host.run_pair, pairs=4, budget_s=300, gate=1.05, clock=host.clock)
    assert host.ran == 4 and looks == 1 and elapsed == 36.0 and judge(est.ci, 1.05) is Verdict.PASS
    assert est.confidence == 0.975  # the first of several possible looks spends half of the 5%


def test_pairs_are_added_until_the_interval_clears_the_gate():
    """Issue 35 item 10: a tax of 1.02 with run-to-run spread cannot be decided by 4 pairs; `measure`
    adds pairs, looking when they double (4, 8, 16, ...), and stops at the look that decides."""
    host = FakeHost(1.02, noise=0.05, run_sd=0.02)
    times, est, looks, elapsed = measure(host.run_pair, pairs=4, budget_s=600, gate=1.05, clock=host.clock)
    assert looks >= 2 and host.ran == 4 * 2 ** (looks - 1) and len(times["deterministic"]) == host.ran
    assert judge(est.ci, 1.05) is Verdict.PASS and est.confidence == 1 - 0.05 / 2 ** looks
    # the same host with budget 0: exactly 4 pairs, one look at the full 95%, undecided
    host = FakeHost(1.02, noise=0.05, run_sd=0.02)
    _, est, looks, _ = measure(host.run_pair, pairs=4, budget_s=0, gate=1.05, clock=host.clock)
    assert host.ran == 4 and looks == 1 and est.confidence == 0.95 and judge(est.ci, 1.05) is Verdict.INCOMPLETE


def test_the_budget_ends_the_measurement_and_the_advice_is_estimated_from_the_spread():
    """When the budget ends undecided, the advice is the pairs that the observed spread needs at
    the next look's confidence, with their time at the observed pace, never a fixed cap (the
    old advice was --pairs 1000, about 100 minutes)."""
    host = FakeHost(1.035, noise=0.06, run_sd=0.03)
    times, est, looks, elapsed = measure(host.run_pair, pairs=4, budget_s=100, gate=1.05, clock=host.clock)
    assert host.ran == 11 and elapsed == 99.0  # a 12th pair would end at 108 s, after the budget
    assert looks == 3  # at 4 and 8 pairs, and the last one when the budget ended
    result = TaxResult("out", {"deterministic": "a", "baseline": "b"}, 2, 1.05, times, est, 0.95, looks, 100.0,
                       elapsed)
    assert result.verdict is Verdict.INCOMPLETE and result.verdict.exit_code == EXIT_CANNOT_RUN
    advice = result.advice
    z = t_quantile(1 - 0.05 / 2 ** 5, 1e9)  # the next look (the 4th) spends 0.05 / 2**4, two-sided
    expected = math.ceil((z * est.pair_sd / abs(math.log(est.ratio / 1.05))) ** 2)
    assert advice["pairs"] == max(12, expected) and advice["seconds"] == pytest.approx(advice["pairs"] * 9.0)
    assert advice["budget_s"] >= 1.2 * advice["seconds"] and advice["budget_s"] % 60 == 0
    assert f"about {advice['pairs']} pairs in all would decide it" in result.judgement
    assert f"rerun with --budget {advice['budget_s']:.0f}" in result.judgement
    assert "(look 3; 95% over all looks)" in result.judgement and "after 11 pair(s) in 99 s (budget 100 s)" in result.judgement


def test_an_adaptive_measurement_never_decides_on_one_pair():
    """One pair's interval holds step noise only (nothing shows run-to-run variation): with a
    budget, the first look waits for a second pair; with --budget 0 and --pairs 1, one pair is
    what was asked for."""
    host = FakeHost(1.0, noise=0.05)
    _, est, looks, _ = measure(host.run_pair, pairs=1, budget_s=300, gate=1.05, clock=host.clock)
    assert host.ran == 2 ** looks and est.pairs == host.ran and est.unit == "steps"  # looks at 2, 4, ...
    assert est.pooling_p is not None and judge(est.ci, 1.05) is Verdict.PASS
    host = FakeHost(1.0, noise=0.05)
    _, est, looks, _ = measure(host.run_pair, pairs=1, budget_s=0, gate=1.05, clock=host.clock)
    assert host.ran == 1 and est.unit == "steps" and est.pooling_p is None


def test_no_advice_to_add_pairs_when_the_ratio_is_on_the_gate():
    det, base = synthetic(1.05, noise=0.05, pairs=4, steps=10, seed=2)
    est = estimate(det, base)
    est = dataclasses.replace(est, ratio=1.05)
    assert pairs_to_decide(est, 1.05, 0.95) is None


def test_looks_spend_at_most_the_error_rate():
    spent = sum(1 - look_confidence(0.95, k, adaptive=True) for k in range(1, 60))
    assert spent < 0.05 and look_confidence(0.95, 1, adaptive=False) == 0.95


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
    code = main(["tax", "--pairs", "1", "--budget", "0", "--warmup", "1", "--gate", "1.05", "--json", "--out",
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
    """CI: the recipe with deterministic mode on and off, one pair of 9 steps, a loose gate.
    Eight timed steps, not two: with two, the interval's t quantile has 1 degree of freedom
    (12.7), and one step slowed by a loaded CI host spanned even a 100x gate (INCOMPLETE)."""
    result = tax(tmp_path / "out", programs=tax_programs(1, steps=9), pairs=1, budget_s=0, warmup=0,
                 gate=100.0)
    assert result.verdict is Verdict.PASS and result.verdict.exit_code == EXIT_OK
    assert 0.2 < result.ratio < 5 and len(result.times["deterministic"][0]) == 8
    assert "deterministic=true" in result.commands["deterministic"]
    assert "deterministic=false" in result.commands["baseline"]
