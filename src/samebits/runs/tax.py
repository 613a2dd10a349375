"""The determinism tax: how much slower the deterministic run is, as a ratio with a confidence
interval, from interleaved paired runs.  Protocol: docs/tax.md.

    result = tax(out="tax-out", pairs=5, steps=12, warmup=2, gate=1.05)   # the reference recipe
    result.ratio, result.ci, result.verdict                                # PASS when ci[1] <= gate

Each pair runs the deterministic command (A) and the baseline (B) back to back, in the order
A B, then B A, ... so slow drifts of the machine fall on both sides.  Step times come from
the runs' step-time files (``rank-NNNNN.steptimes``, written beside each stream; the
comparator never reads them): the step time is the wall time from one step's first record to
the next step's, the slowest rank's.  Warm-up steps are dropped.  The ratio is the median of
the per-step ratios A/B (step s of A against step s of its paired B: the same data, the same
work); its confidence interval comes from a paired bootstrap that resamples pairs of runs and
then steps within each pair, so both run-to-run and step-to-step variation widen it.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from samebits.autorecord import environment_for
from samebits.defaults import DEFAULT_GATE
from samebits.errors import ConfigError, SamebitsError
from samebits.runs._launch import DEFAULT_TIMEOUT_S, judge_recipe_run, judge_recorded_run, run_logged
from samebits.runs.commands import OUT, SelfRecording, check_out_dir, default_out_dir, fill_placeholders, write_summary
from samebits.stream import STEP_TIMES_SUFFIX
from samebits.verdicts import ToDict, Verdict, serialised

DEFAULT_RESAMPLES = 4000
DETERMINISTIC_PLACEHOLDER = "{deterministic}"
_LABELS = ("deterministic", "baseline")
# The one estimator of the tax: the headline ratio, its interval and the medians shown beside it agree.
ESTIMATOR = "ratio of median step times (deterministic / baseline)"


@dataclasses.dataclass
class TaxResult(ToDict):
    """The measured tax.  ``times[label][pair]`` holds the kept per-step seconds of that run."""

    dict_keys = ("verdict", "exit_code", "ratio", "estimator", "judgement", "ci", "confidence", "gate", "pairs",
                 "warmup_steps_dropped", "steps_per_run", "median_step_s", "resamples", "seed", "commands", "out",
                 "times_s", "notes")

    out: str
    commands: dict[str, str]
    pairs: int
    warmup: int = dataclasses.field(metadata=serialised(key="warmup_steps_dropped"))
    gate: float
    times: dict[str, list[list[float]]] = dataclasses.field(metadata=serialised(key="times_s"))
    ratio: float
    ci: tuple[float, float]
    confidence: float
    resamples: int
    seed: int
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        return judge(self.ci, self.gate)

    @property
    def judgement(self) -> str:
        """The verdict's reason, in one sentence (what to do when it is inconclusive)."""
        low, high = self.ci
        interval = f"{100 * self.confidence:.0f}% CI {low:.3f}-{high:.3f}"
        if self.verdict is Verdict.PASS:
            return f"the {interval} is within the gate {self.gate:.3f}"
        if self.verdict is Verdict.FAIL:
            return f"the whole {interval} is over the gate {self.gate:.3f}"
        return (f"inconclusive: the {interval} spans the gate {self.gate:.3f}: add pairs "
                f"(--pairs {pairs_to_decide(self.pairs, self.ratio, self.ci, self.gate)})")

    def dict_extras(self) -> dict:
        medians = {label: float(np.median(np.concatenate([np.asarray(t) for t in runs])))
                   for label, runs in self.times.items()}
        return {"verdict": self.verdict, "exit_code": self.verdict.exit_code, "estimator": ESTIMATOR,
                "judgement": self.judgement, "steps_per_run": len(self.times[_LABELS[0]][0]),
                "median_step_s": medians}


def judge(ci: tuple[float, float], gate: float) -> Verdict:
    """PASS when the whole interval is at or under the gate, FAIL when it is wholly over it, and
    INCOMPLETE when it spans the gate: the measurement cannot tell (a busy machine, too few
    pairs), so it neither passes nor fails the change; `TaxResult.judgement` says how many pairs
    to run."""
    low, high = ci
    if high <= gate:
        return Verdict.PASS
    if low > gate:
        return Verdict.FAIL
    return Verdict.INCOMPLETE


def pairs_to_decide(pairs: int, ratio: float, ci: tuple[float, float], gate: float) -> int:
    """About how many pairs would make an interval like ``ci`` clear ``gate``: its width falls
    as 1/sqrt(pairs), and it must shrink to twice the distance from ``ratio`` to the gate
    (at least double the pairs; at most 1,000)."""
    width, distance = ci[1] - ci[0], abs(ratio - gate)
    if distance < width / 2000:  # a ratio (almost) on the gate: no number of pairs is enough
        return 1000
    return min(1000, max(2 * pairs, math.ceil(pairs * (width / (2 * distance)) ** 2)))


def paired_bootstrap(deterministic: list[list[float]], baseline: list[list[float]], *,
                     resamples: int = DEFAULT_RESAMPLES, confidence: float = 0.95,
                     seed: int = 0) -> tuple[float, tuple[float, float]]:
    """The tax (`ESTIMATOR`: the median step time of A over that of B, the two medians a
    report shows) and its percentile bootstrap interval.

    ``deterministic[i][s]`` and ``baseline[i][s]`` are step s of pair i.  Each resample draws
    the pairs with replacement, then the steps of each drawn pair with replacement (a two-level
    bootstrap: steps of one run share its machine state, so pairs are the independent unit),
    the same draws for A and B (paired), and takes the same statistic."""
    if not deterministic or len(deterministic) != len(baseline):
        raise ConfigError("paired_bootstrap: give the same number (>= 1) of deterministic and baseline runs.")
    lengths = {len(run) for run in deterministic} | {len(run) for run in baseline}
    if len(lengths) != 1 or 0 in lengths:
        raise ConfigError(f"paired_bootstrap: every run must keep the same number (>= 1) of steps; got {sorted(lengths)}.")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence={confidence}: must be between 0 and 1, e.g. 0.95.")
    a, b = np.asarray(deterministic, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if (a <= 0).any() or (b <= 0).any() or not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ConfigError("paired_bootstrap: step times must be positive, finite seconds.")
    num_pairs, num_steps = a.shape
    rng = np.random.default_rng(seed)
    chosen_pairs = rng.integers(0, num_pairs, size=(resamples, num_pairs))
    chosen_steps = rng.integers(0, num_steps, size=(resamples, num_pairs, num_steps))
    drawn = (chosen_pairs[:, :, None], chosen_steps)
    statistics = (np.median(a[drawn].reshape(resamples, -1), axis=1)
                  / np.median(b[drawn].reshape(resamples, -1), axis=1))
    tail = (1 - confidence) / 2
    low, high = np.quantile(statistics, [tail, 1 - tail])
    return float(np.median(a) / np.median(b)), (float(low), float(high))


def read_step_times(run_dir: str | Path) -> dict[int, float]:
    """Per-step seconds of a recorded run: the time from a step's first record to the next
    step's (consecutive steps only), the slowest rank's.  The last step has no successor and
    no time."""
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


def tax(out: str | Path | None = None, *, command: list[str] | None = None, command_a: str | None = None,
        command_b: str | None = None, programs: Mapping[str, SelfRecording] | None = None, pairs: int = 5,
        warmup: int = 2, gate: float = DEFAULT_GATE, resamples: int = DEFAULT_RESAMPLES, confidence: float = 0.95,
        seed: int = 0, run_timeout: float | None = DEFAULT_TIMEOUT_S,
        progress: Callable[[str], None] | None = None) -> TaxResult:
    """Measure the determinism tax with ``pairs`` interleaved paired runs.

    ``programs``: a program that records itself (its ``record`` template, ``{out}`` the run's
    stream folder) for "deterministic" (A) and "baseline" (B): the reference recipe with
    ``deterministic=true`` and ``false`` (`samebits.recipes.commands`).  ``command``: one command
    run under zero-code recording, with ``{deterministic}`` expanded to 1 (A) and 0 (B).
    ``command_a`` and ``command_b``: two commands (shell words), A the deterministic one.
    ``{out}`` in a zero-code command is that run's own work folder.  The first ``warmup`` timed
    steps of every run are dropped.
    """
    if pairs < 1:
        raise ConfigError(f"--pairs {pairs}: at least 1 pair (5 or more for a useful interval).")
    if warmup < 0:
        raise ConfigError(f"--warmup {warmup}: cannot drop a negative number of steps.")
    if gate <= 0:
        raise ConfigError(f"--gate {gate}: a ratio gate is a positive number, e.g. 1.05.")
    if resamples < 100:
        raise ConfigError(f"--resamples {resamples}: at least 100 bootstrap resamples.")
    modes = [command is not None, command_a is not None or command_b is not None, programs is not None]
    if sum(modes) > 1:
        raise ConfigError("give either `-- CMD` (with {deterministic}) or --a 'CMD' --b 'CMD', not both.")
    if not any(modes):
        raise ConfigError("no command to time: give `-- CMD` (with {deterministic}), --a 'CMD' --b 'CMD', or the "
                          "programs of a deterministic and a baseline run.")
    if modes[1] and (command_a is None or command_b is None):
        raise ConfigError("--a and --b go together: --a is the deterministic command, --b the baseline.")
    if command is not None:
        if not command:
            raise ConfigError("no command after `--`: write `samebits tax -- python train.py --det {deterministic}`.")
        if not any(DETERMINISTIC_PLACEHOLDER in part for part in command):
            raise ConfigError(f"the command has no {DETERMINISTIC_PLACEHOLDER}: samebits cannot switch your script's "
                              "deterministic mode. Put {deterministic} where it takes the switch (it becomes 1 for the "
                              "deterministic run and 0 for the baseline), or give two commands with --a and --b.")
    recipe = programs is not None
    if recipe and set(programs) != set(_LABELS):
        raise ConfigError(f"tax: programs for {', '.join(_LABELS)} (got {', '.join(programs) or 'none'})")
    steps = programs["deterministic"].steps if recipe else None
    if recipe and steps < warmup + 2:
        raise ConfigError(f"--steps {steps} with --warmup {warmup}: the recipe needs at least {warmup + 2} steps "
                          "(the last step has no time, and at least one must remain after the warm-up).")
    out = check_out_dir(out if out is not None else default_out_dir("tax"))
    say = progress or (lambda message: None)

    if recipe:
        argvs = {label: list(programs[label].record) for label in _LABELS}
        programs["deterministic"].refuse_early()  # the program's options and config, before any run
    elif command is not None:
        argvs = {label: [part.replace(DETERMINISTIC_PLACEHOLDER, "1" if label == "deterministic" else "0")
                         for part in command] for label in _LABELS}
    else:
        argvs = {"deterministic": shlex.split(command_a), "baseline": shlex.split(command_b)}
    times: dict[str, list[list[float]]] = {label: [] for label in _LABELS}
    notes: list[str] = []
    for pair in range(pairs):
        order = _LABELS if pair % 2 == 0 else _LABELS[::-1]  # A B, B A, A B, ...
        for label in order:
            run_dir = out / f"pair-{pair}" / label
            work = out / "work" / f"pair-{pair}-{label}"
            work.mkdir(parents=True, exist_ok=True)
            argv = fill_placeholders(argvs[label], {OUT: run_dir if recipe else work})
            log = out / "logs" / f"pair-{pair}-{label}.log"
            say(f"[pair {pair + 1}/{pairs}] {label}: {shlex.join(argv)}")
            if recipe:  # it records itself into run_dir
                code, seconds = run_logged(argv, log, label=f"{label} (pair {pair})", timeout=run_timeout,
                                           progress=progress, streams=run_dir, steps=steps)
                judge_recipe_run(f"{label} (pair {pair})", argv, code, log, stopped=False)
            else:
                env = environment_for(run_dir, command=shlex.join(argv))
                code, seconds = run_logged(argv, log, env=env, label=f"{label} (pair {pair})", timeout=run_timeout,
                                           progress=progress, streams=run_dir)
                note = judge_recorded_run(f"{label} (pair {pair})", argv, code, run_dir, log)
                if note:
                    notes.append(f"{label} (pair {pair}): {note}")
            step_times = read_step_times(run_dir)
            kept = [step_times[s] for s in sorted(step_times)][warmup:]
            if not kept:
                raise SamebitsError(f"{label} run of pair {pair} ({run_dir}) timed {len(step_times)} step(s), all "
                                    f"dropped as warm-up (--warmup {warmup}); run more steps or drop fewer.")
            times[label].append(kept)
            say(f"      done in {seconds:.1f} s: median step {1000 * float(np.median(kept)):.1f} ms over {len(kept)} steps")
    lengths = {len(run) for runs in times.values() for run in runs}
    if len(lengths) != 1:
        shortest = min(lengths)
        notes.append(f"runs timed different numbers of steps ({sorted(lengths)}); each is cut to its first {shortest}")
        times = {label: [run[:shortest] for run in runs] for label, runs in times.items()}
    ratio, ci = paired_bootstrap(times["deterministic"], times["baseline"], resamples=resamples,
                                 confidence=confidence, seed=seed)
    commands = {label: shlex.join(argv) for label, argv in argvs.items()}
    result = TaxResult(str(out), commands, pairs, warmup, gate, times, ratio, ci, confidence, resamples, seed, notes)
    write_summary(out, result, "tax.json")
    return result


__all__ = ["tax", "TaxResult", "paired_bootstrap", "judge", "pairs_to_decide", "read_step_times", "DEFAULT_GATE",
           "ESTIMATOR"]
