"""The determinism tax: how much slower the deterministic run is, as a ratio with a confidence
interval, from interleaved paired runs, measured until it decides.  Protocol and statistics
(paired steps, one trimmed block estimate per pair, pooling only when the F test allows,
Bonferroni over the looks): docs/tax.md.

    result = tax(out="tax-out", programs=..., pairs=4, budget_s=300, gate=1.05)   # samebits.runners.program
    result.ratio, result.ci, result.verdict                       # PASS when ci[1] <= gate

Step times come from the runs' step-time files (``rank-NNNNN.steptimes``, beside each stream;
the comparator never reads them); the first ``warmup`` timed steps of every run are dropped.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from samebits.defaults import DEFAULT_GATE
from samebits.errors import ConfigError, SamebitsError
from samebits.runners._launch import DEFAULT_TIMEOUT_S, run_logged
from samebits.runners.commands import check_out_dir, default_out_dir, write_summary
from samebits.runners.program import RECORD, Program
from samebits.stream import STEP_TIMES_SUFFIX
from samebits.verdicts import ToDict, Verdict, serialised

DEFAULT_PAIRS = 4  # pairs before the first look
DEFAULT_BUDGET_S = 300.0  # wall time after which no pair is added
TRIM = 0.2  # share of each pair's step ratios trimmed at each end
POOL_ALPHA = 0.25  # the pooling test's level: pool steps only when pairs agree clearly enough
_LABELS = ("deterministic", "baseline")
# The one estimator of the tax: the headline ratio, its interval and the typical steps shown beside it agree.
ESTIMATOR = ("geometric mean of paired step-time ratios (step s of the deterministic run over step s of its "
             "pair's baseline), 20% trimmed in each pair")


@dataclasses.dataclass(frozen=True)
class TaxEstimate(ToDict):
    """One look's statistics (docs/tax.md).  ``unit``: what the interval counts as samples,
    "steps" (pooled) or "pairs"; ``typical_step_s``: per label, the geometric mean of the steps
    kept, so ``ratio`` is their quotient; ``pair_sd``: one pair's log-ratio spread under ``unit``
    (it sizes the advice); ``pooling_f``/``pooling_p``: the pooling test (None with one pair)."""

    ratio: float
    ci: tuple[float, float]
    confidence: float
    unit: str
    df: float
    pairs: int
    steps_per_pair: int
    steps_kept: int
    pair_sd: float
    pooling_f: float | None
    pooling_p: float | None
    typical_step_s: dict[str, float]


def estimate(deterministic: list[list[float]], baseline: list[list[float]], *,
             confidence: float = 0.95, trim: float = TRIM, pool_alpha: float = POOL_ALPHA) -> TaxEstimate:
    """The tax and its ``confidence`` interval from per-step seconds: ``deterministic[i][s]``
    and ``baseline[i][s]`` are step s of pair i (every run the same number of steps)."""
    if not deterministic or len(deterministic) != len(baseline):
        raise ConfigError("tax estimate: give the same number (>= 1) of deterministic and baseline runs.")
    lengths = {len(run) for run in deterministic} | {len(run) for run in baseline}
    if len(lengths) != 1 or 0 in lengths:
        raise ConfigError(f"tax estimate: every run must keep the same number (>= 1) of steps; got {sorted(lengths)}.")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence={confidence}: must be between 0 and 1, e.g. 0.95.")
    a, b = np.asarray(deterministic, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if (a <= 0).any() or (b <= 0).any() or not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ConfigError("tax estimate: step times must be positive, finite seconds.")
    log_a, log_b = np.log(a), np.log(b)
    ratios = log_a - log_b  # (pairs, steps): step s of A over step s of its B
    num_pairs, num_steps = ratios.shape
    cut = int(math.floor(trim * num_steps))
    kept = num_steps - 2 * cut
    order = np.argsort(ratios, axis=1, kind="stable")[:, cut:num_steps - cut]  # the steps kept, per pair
    rows = np.arange(num_pairs)[:, None]
    blocks = ratios[rows, order].mean(axis=1)  # one trimmed mean per pair
    center = float(blocks.mean())
    typical = {"deterministic": float(np.exp(log_a[rows, order].mean())),
               "baseline": float(np.exp(log_b[rows, order].mean()))}
    # Yuen: the trimmed mean's variance from the winsorized variance, (S-1) s_w^2 / (h (h-1)).
    if kept >= 2:
        ranked = np.sort(ratios, axis=1)
        winsorized = np.clip(ratios, ranked[:, cut:cut + 1], ranked[:, num_steps - cut - 1:num_steps - cut])
        within = (num_steps - 1) * winsorized.var(axis=1, ddof=1) / (kept * (kept - 1))
        within_var, within_df = float(within.mean()), num_pairs * (kept - 1)
    else:
        within_var, within_df = math.nan, 0
    between_var = float(blocks.var(ddof=1)) if num_pairs >= 2 else math.nan
    pooling_f = pooling_p = None
    if num_pairs >= 2 and within_df > 0:
        pooling_f = between_var / within_var if within_var > 0 else (1.0 if between_var == 0 else math.inf)
        pooling_p = f_sf(pooling_f, num_pairs - 1, within_df)
    if num_pairs == 1 and within_df > 0:  # no second pair to see run-to-run variation: steps only
        unit, var, df = "steps", within_var, within_df
    elif pooling_p is not None and pooling_p > pool_alpha:
        unit = "steps"
        df = (num_pairs - 1) + within_df
        var = ((num_pairs - 1) * between_var + within_df * within_var) / df
    elif num_pairs >= 2:
        unit, var, df = "pairs", between_var, num_pairs - 1
    else:  # one pair of one kept step: no spread to measure
        unit, var, df = "pairs", math.inf, 0
    if var == 0:
        half = 0.0
    elif math.isfinite(var) and df > 0:
        half = t_quantile(0.5 + confidence / 2, df) * math.sqrt(var / num_pairs)
    else:
        half = math.inf
    return TaxEstimate(ratio=math.exp(center), ci=(math.exp(center - half), math.exp(center + half)),
                       confidence=confidence, unit=unit, df=float(df), pairs=num_pairs, steps_per_pair=num_steps,
                       steps_kept=kept, pair_sd=math.sqrt(var) if math.isfinite(var) else math.inf,
                       pooling_f=pooling_f, pooling_p=pooling_p, typical_step_s=typical)


def judge(ci: tuple[float, float], gate: float) -> Verdict:
    """PASS when the whole interval is at or under the gate, FAIL when wholly over it, INCOMPLETE
    when it spans the gate (the measurement cannot tell)."""
    low, high = ci
    if high <= gate:
        return Verdict.PASS
    if low > gate:
        return Verdict.FAIL
    return Verdict.INCOMPLETE


def look_confidence(confidence: float, look: int, adaptive: bool) -> float:
    """The confidence of look ``look`` (1-based): all of it for a measurement that looks once,
    else the k-th look spends (1 - confidence) / 2**k, which sums to under 1 - confidence."""
    return confidence if not adaptive else 1 - (1 - confidence) / 2 ** look


def pairs_to_decide(est: TaxEstimate, gate: float, confidence: float) -> int | None:
    """About how many pairs in all would clear ``gate`` at ``confidence``: n = (z sd / |log ratio -
    log gate|)^2 from ``est``'s spread; None for a ratio on the gate or no spread measured."""
    margin = abs(math.log(est.ratio) - math.log(gate))
    if not math.isfinite(est.pair_sd) or margin < 1e-4:
        return None
    z = _normal_quantile(0.5 + confidence / 2)
    return max(est.pairs + 1, math.ceil((z * est.pair_sd / margin) ** 2))


# --- Student t and F distributions (numpy has none; samebits does not depend on scipy) -----------

def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 500):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * fraction / a


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (p in (0.5, 1)), by bisection on `t_cdf`."""
    if df > 1e7:  # the normal, to 1e-7; the incomplete beta loses digits this close to x = 1
        return _normal_quantile(p)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:
        high *= 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2


def f_sf(f: float, df_num: float, df_den: float) -> float:
    """P(F > f) for the F distribution with (``df_num``, ``df_den``) degrees of freedom."""
    if f <= 0:
        return 1.0
    if math.isinf(f):
        return 0.0
    return _betainc(df_den / 2, df_num / 2, df_den / (df_den + df_num * f))


def _normal_quantile(p: float) -> float:
    """The ``p`` quantile of the standard normal (p in (0.5, 1)), by bisection on math.erf."""
    low, high = 0.0, 40.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if 0.5 * (1 + math.erf(middle / math.sqrt(2))) < p else (low, middle)
    return (low + high) / 2


# --- the measurement ------------------------------------------------------------------------------

@dataclasses.dataclass
class TaxResult(ToDict):
    """The measured tax: the last look's `TaxEstimate`; ``times[label][pair]`` the kept step seconds."""

    summary_of = "tax"  # its summary.json names the command that wrote it
    dict_keys = ("verdict", "exit_code", "ratio", "estimator", "judgement", "ci", "confidence", "look_confidence",
                 "looks", "samples", "pooling", "gate", "pairs", "steps_per_run", "steps_kept_per_pair",
                 "typical_step_s", "advice", "budget_s", "elapsed_s", "seconds_per_pair", "warmup_steps_dropped",
                 "commands", "out", "times_s", "notes")

    out: str
    commands: dict[str, str]
    warmup: int = dataclasses.field(metadata=serialised(key="warmup_steps_dropped"))
    gate: float
    times: dict[str, list[list[float]]] = dataclasses.field(metadata=serialised(key="times_s"))
    estimate: TaxEstimate = dataclasses.field(metadata=serialised(skip=True))
    confidence: float
    looks: int = 1
    budget_s: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.estimate.ratio

    @property
    def ci(self) -> tuple[float, float]:
        return self.estimate.ci

    @property
    def pairs(self) -> int:
        return self.estimate.pairs

    @property
    def seconds_per_pair(self) -> float:
        return self.elapsed_s / self.pairs if self.pairs else 0.0

    @property
    def verdict(self) -> Verdict:
        return judge(self.ci, self.gate)

    @property
    def advice(self) -> dict | None:
        """For an undecided result: the pairs in all that would likely decide it at the next
        look's confidence, and the time they would take (None: no number of pairs will)."""
        if self.verdict is not Verdict.INCOMPLETE:
            return None
        adaptive = self.budget_s > 0
        needed = pairs_to_decide(self.estimate, self.gate, look_confidence(self.confidence, self.looks + 1, adaptive))
        if needed is None:
            return None
        seconds = needed * self.seconds_per_pair
        return {"pairs": needed, "seconds": seconds, "budget_s": _round_up_minutes(1.2 * seconds)}

    @property
    def judgement(self) -> str:
        """The verdict's reason, in one sentence (what to do when it is inconclusive)."""
        est = self.estimate
        low, high = est.ci
        interval = f"{_percent(est.confidence)} CI {low:.3f}-{high:.3f}"
        if self.looks > 1 or self.budget_s > 0:
            interval += f" (look {self.looks}; {_percent(self.confidence)} over all looks)"
        if self.verdict is Verdict.PASS:
            return f"the {interval} is within the gate {self.gate:.3f}"
        if self.verdict is Verdict.FAIL:
            return f"the whole {interval} is over the gate {self.gate:.3f}"
        spent = (f"after {self.pairs} pair(s) in {_duration(self.elapsed_s)}"
                 + (f" (budget {_duration(self.budget_s)})" if self.budget_s > 0 else ""))
        advice = self.advice
        if advice is None:
            return (f"inconclusive: the {interval} spans the gate {self.gate:.3f} {spent}, and the ratio is on "
                    "the gate: no number of pairs would decide it; the tax is at the gate")
        return (f"inconclusive: the {interval} spans the gate {self.gate:.3f} {spent}; from the spread seen, "
                f"about {advice['pairs']} pairs in all would decide it, about {_duration(advice['seconds'])} "
                f"of runs (estimate): rerun with --budget {advice['budget_s']:.0f}")

    def dict_extras(self) -> dict:
        est = self.estimate
        return {"verdict": self.verdict, "exit_code": self.verdict.exit_code, "ratio": est.ratio, "ci": est.ci,
                "estimator": ESTIMATOR, "judgement": self.judgement, "look_confidence": est.confidence,
                "samples": est.unit, "pooling": {"f": est.pooling_f, "p": est.pooling_p, "alpha": POOL_ALPHA,
                                                 "df": est.df},
                "pairs": est.pairs, "steps_per_run": est.steps_per_pair, "steps_kept_per_pair": est.steps_kept,
                "typical_step_s": est.typical_step_s, "advice": self.advice,
                "seconds_per_pair": self.seconds_per_pair}


def _percent(confidence: float) -> str:
    text = f"{100 * confidence:.2f}".rstrip("0").rstrip(".")
    return f"{text}%"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _round_up_minutes(seconds: float) -> float:
    return 60.0 * max(1, math.ceil(seconds / 60))


def read_step_times(run_dir: str | Path) -> dict[int, float]:
    """Per-step seconds of a recorded run, the slowest rank's: from a step's first record to the
    next step's (consecutive steps only; the last step has no time)."""
    files = sorted(Path(run_dir).glob(f"rank-*{STEP_TIMES_SUFFIX}"))
    if not files:
        raise SamebitsError(f"{run_dir}: no step times (rank-NNNNN{STEP_TIMES_SUFFIX}): the run recorded no "
                            "step, or was recorded by a samebits without them.")
    slowest: dict[int, float] = {}
    for path in files:
        opened: list[tuple[int, float]] = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("{"):  # a segment's header: a new clock origin
                opened.append((-1, float("nan")))
                continue
            try:
                step_text, start_text, _ = line.split("\t")
                opened.append((int(step_text), float(start_text)))
            except ValueError:
                raise SamebitsError(f"{path}:{number}: not a step-time line ({line[:60]!r}); the file is "
                                    "damaged.") from None
        for (step, start), (next_step, next_start) in zip(opened, opened[1:]):
            if step >= 0 and next_step == step + 1:
                slowest[step] = max(slowest.get(step, 0.0), next_start - start)
    return slowest


def measure(run_pair: Callable[[int], tuple[list[float], list[float]]], *, pairs: int = DEFAULT_PAIRS,
            budget_s: float = DEFAULT_BUDGET_S, gate: float = DEFAULT_GATE, confidence: float = 0.95,
            clock: Callable[[], float] = time.monotonic,
            say: Callable[[str], None] = lambda message: None) -> tuple[dict[str, list[list[float]]], TaxEstimate, int, float]:
    """Run pairs (``run_pair(i)``: pair i's kept step seconds, deterministic then baseline), looking
    after ``pairs`` pairs and each time they double, until the interval clears ``gate`` or another
    pair would end after ``budget_s`` (0: exactly ``pairs`` pairs, one look).  Returns the times
    (cut to the shortest run), the last estimate, the number of looks and the seconds spent."""
    adaptive = budget_s > 0
    start = clock()
    times: dict[str, list[list[float]]] = {label: [] for label in _LABELS}
    # One pair cannot show run-to-run variation: an adaptive measurement looks at two or more.
    looks, next_look = 0, max(pairs, 2) if adaptive else pairs
    while True:
        det, base = run_pair(len(times["deterministic"]))
        times["deterministic"].append(list(det))
        times["baseline"].append(list(base))
        done, elapsed = len(times["deterministic"]), clock() - start
        out_of_time = adaptive and elapsed * (done + 1) / done > budget_s
        if done < pairs or (done < next_look and not out_of_time):
            continue
        looks += 1
        shortest = min(len(run) for runs in times.values() for run in runs)
        cut = {label: [run[:shortest] for run in runs] for label, runs in times.items()}
        est = estimate(cut["deterministic"], cut["baseline"], confidence=look_confidence(confidence, looks, adaptive))
        verdict = judge(est.ci, gate)
        say(f"look {looks} after {done} pair(s), {elapsed:.0f} s: {est.ratio:.3f}x, {_percent(est.confidence)} CI "
            f"{est.ci[0]:.3f}-{est.ci[1]:.3f} ({est.unit} as samples): {verdict.value}")
        if verdict is not Verdict.INCOMPLETE or not adaptive or out_of_time:
            return cut, est, looks, elapsed
        next_look = 2 * done


def tax(out: str | Path | None = None, *, programs: Mapping[str, Program], pairs: int = DEFAULT_PAIRS,
        budget_s: float = DEFAULT_BUDGET_S, warmup: int = 2, gate: float = DEFAULT_GATE, confidence: float = 0.95,
        run_timeout: float | None = DEFAULT_TIMEOUT_S, progress: Callable[[str], None] | None = None) -> TaxResult:
    """Measure the determinism tax with interleaved paired runs until it decides (`measure`).
    ``programs``: the "deterministic" and "baseline" programs, each run in its RECORD role."""
    if pairs < 1:
        raise ConfigError(f"--pairs {pairs}: at least 1 pair (4 or more for a useful interval).")
    if not 0 <= budget_s < math.inf:
        raise ConfigError(f"--budget {budget_s}: seconds, 0 or more (0 runs exactly --pairs pairs).")
    if warmup < 0:
        raise ConfigError(f"--warmup {warmup}: cannot drop a negative number of steps.")
    if not 0 < gate < math.inf:
        raise ConfigError(f"--gate {gate}: a ratio gate is a positive number, e.g. 1.05.")
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence {confidence}: a number between 0 and 1, e.g. 0.95.")
    if set(programs) != set(_LABELS):
        raise ConfigError(f"tax: programs for {', '.join(_LABELS)} (got {', '.join(programs) or 'none'})")
    steps = programs["deterministic"].steps
    if steps is not None and steps < warmup + 2:
        raise ConfigError(f"--steps {steps} with --warmup {warmup}: the recipe needs at least {warmup + 2} steps "
                          "(the last step has no time, and at least one must remain after the warm-up).")
    out = check_out_dir(out if out is not None else default_out_dir("tax"))
    say = progress or (lambda message: None)
    programs["deterministic"].refuse_early()  # the program's options and config, before any run
    notes: list[str] = []
    lengths: set[int] = set()

    def run_pair(pair: int) -> tuple[list[float], list[float]]:
        kept_by_label = {}
        order = _LABELS if pair % 2 == 0 else _LABELS[::-1]  # A B, B A, A B, ...
        for label in order:
            name, program = f"{label} (pair {pair})", programs[label]
            launch = program.launch(RECORD, out / f"pair-{pair}" / label, work=out / "work" / f"pair-{pair}-{label}")
            log = out / "logs" / f"pair-{pair}-{label}.log"
            say(f"[pair {pair + 1}] {label}: {shlex.join(launch.argv)}")
            code, seconds = run_logged(launch.argv, log, env=launch.env, label=name, timeout=run_timeout,
                                       progress=progress, streams=launch.streams, steps=program.steps)
            note = program.judge(name, launch, code, log)
            if note:
                notes.append(f"{name}: {note}")
            step_times = read_step_times(launch.streams)
            kept = [step_times[s] for s in sorted(step_times)][warmup:]
            if not kept:
                raise SamebitsError(f"{label} run of pair {pair} ({launch.streams}) timed {len(step_times)} step(s), "
                                    f"all dropped as warm-up (--warmup {warmup}); run more steps or drop fewer.")
            kept_by_label[label] = kept
            lengths.add(len(kept))
            say(f"      done in {seconds:.1f} s: median step {1000 * float(np.median(kept)):.1f} ms over {len(kept)} steps")
        return kept_by_label["deterministic"], kept_by_label["baseline"]

    times, est, looks, elapsed = measure(run_pair, pairs=pairs, budget_s=budget_s, gate=gate, confidence=confidence,
                                         say=say)
    if len(lengths) != 1:
        notes.append(f"runs timed different numbers of steps ({sorted(lengths)}); each is cut to its first "
                     f"{min(lengths)}")
    commands = {label: shlex.join(programs[label].template(RECORD)) for label in _LABELS}
    result = TaxResult(str(out), commands, warmup, gate, times, est, confidence, looks, budget_s, elapsed, notes)
    write_summary(out, result, "tax.json")
    return result


__all__ = ["tax", "measure", "estimate", "TaxResult", "TaxEstimate", "judge", "look_confidence", "pairs_to_decide",
           "read_step_times", "t_quantile", "f_sf", "DEFAULT_GATE", "DEFAULT_PAIRS", "DEFAULT_BUDGET_S", "ESTIMATOR"]
