"""Recorder overhead on the reference recipe: step time with recording on versus off.

    python benchmarks/bench_recipe.py [--blocks 40] [--reps 300] [--json]

One process (world size 1), the default recipe config, one model trained once.  The modes
take turns step by step: each *block* runs one training step per mode, in a fresh random
order, so every mode sees the same machine (other processes, turbo, cache state) and the
same point of training.  A mode's overhead is the median over blocks of its step time divided by
that of "off" in the same block, minus one, with a 95% bootstrap confidence interval (blocks
resampled): on a shared machine, read the interval, not the point.  The ratio of the summed step
times (the cost over a whole run, more sensitive to a load spike) is printed beside it.  Separate
processes of this benchmark differ by more than one interval (a process's memory placement
decides its step time: 42 or 56 ms here); pool several runs before concluding.  The same is reported in process CPU
time (`time.process_time` around each step, all threads): a process that is descheduled by
others accrues none, so with OMP_NUM_THREADS=1 (no spinning worker threads) the CPU-time
overhead is the steadier figure on a busy machine (it still sees cache and memory contention).

Modes: "off" passes no recorder; "params+grads" fingerprints every gradient and parameter
each step (the issue's measure); "everything" records all the recipe records (state census,
tokens, block outputs and logits, metrics, gradients, parameters, global parameter digests).
"no-op recorder" runs the recipe's own recording code for params+grads with a recorder that
does nothing (the *plumbing*: the recipe builds no record a recorder's `wants` declines);
"digest only" adds one batched `body_sums` of the grads and of the params, nothing written:
the digest's own floor (with one rank every global digest is a local one, digested once by
`Recorder.tensors_and_global`, which the recipe calls for the params).

The split of params+grads, in two ways.  In the steps: the time spent inside the recorder
per step ("record": its `tensors`/`global_tensors`/`metrics` bookkeeping, less the digest,
which is timed apart on the same tensors right after the step; "encode": `end_step` fetching
the sums, finalizing and building the records and the frame; "write": the file write and
flush).  In a tight loop (--reps): the same records of the last step recorded again and
again, each part's median with a bootstrap interval; steadier, and what a code change to the
recorder moves.  "Plumbing" is the no-op recorder's overhead.  Target: params+grads overhead
under 2% of step time.

Uses `samebits.recipes.loop._Run` (the per-rank state of `train`) to run single steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from array import array
from pathlib import Path

import numpy as np
import torch

import samebits
from samebits.fingerprint import _native, body_sums, global_body_sums
from samebits.fingerprint._digest import body_sums_of_checked  # the Recorder's call plans use it
from samebits.recipes import RecipeConfig, session
from samebits.recipes.loop import _Run

WARMUP_BLOCKS = 2
BOOTSTRAP_RESAMPLES = 2000


class _NoOpRecorder:
    """The recorder interface the recipe calls, doing nothing: isolates the recipe's own cost.
    It wants the phases params+grads records (as that Recorder's `wants` says), so the recipe
    builds the same records for both."""

    def wants(self, step, phase):
        return phase in ("grads", "params")

    def tensors(self, step, phase, named_tensors):
        pass

    def tensors_and_global(self, step, phase, named_tensors, group=None):
        pass

    def metrics(self, step, **values):
        pass

    def end_step(self, step):
        return None

    def close(self):
        pass


class _DigestOnly(_NoOpRecorder):
    def tensors(self, step, phase, named_tensors):
        if phase in ("grads", "params"):
            body_sums([t for _, t in named_tensors])

    def tensors_and_global(self, step, phase, named_tensors, group=None):
        self.tensors(step, phase, named_tensors)  # one rank: the global digests are the local ones


class _Timed:
    """Wraps a Recorder and adds the seconds spent in each of its calls to `spent`."""

    def __init__(self, recorder: samebits.Recorder):
        self.recorder = recorder
        self.spent = {"record": 0.0, "encode": 0.0, "write": 0.0}
        self.last: dict[str, list] = {}  # the step's tensors, to time their digest apart
        self.last_metrics: dict | None = None  # None: the recorder wants no metrics
        self._sums = np.zeros(0, dtype=np.uint64)  # digest_seconds writes its sums here
        flush = recorder._flush

        def timed_flush():
            start = time.perf_counter()
            flush()
            self.spent["write"] += time.perf_counter() - start

        recorder._flush = timed_flush

    def wants(self, step, phase):
        # Without it the recipe builds every phase's records (census, block outputs, metrics)
        # for the recorder to drop: ~1.5 ms a step that the recorder's own timers never saw.
        return self.recorder.wants(step, phase)

    def tensors(self, step, phase, named_tensors):
        named_tensors = list(named_tensors)
        self.last[phase] = named_tensors
        start = time.perf_counter()
        self.recorder.tensors(step, phase, named_tensors)
        self.spent["record"] += time.perf_counter() - start

    def global_tensors(self, step, phase, named_tensors, group=None):
        named_tensors = list(named_tensors)
        self.last["global:" + phase] = named_tensors
        start = time.perf_counter()
        self.recorder.global_tensors(step, phase, named_tensors, group=group)
        self.spent["record"] += time.perf_counter() - start

    def tensors_and_global(self, step, phase, named_tensors, group=None):
        named_tensors = list(named_tensors)
        self.last["both:" + phase] = named_tensors
        start = time.perf_counter()
        self.recorder.tensors_and_global(step, phase, named_tensors, group=group)
        self.spent["record"] += time.perf_counter() - start

    def metrics(self, step, **values):
        self.last_metrics = values
        start = time.perf_counter()
        self.recorder.metrics(step, **values)
        self.spent["record"] += time.perf_counter() - start

    def end_step(self, step):
        write_before = self.spent["write"]
        start = time.perf_counter()
        result = self.recorder.end_step(step)
        self.spent["encode"] += time.perf_counter() - start - (self.spent["write"] - write_before)
        return result

    def close(self):
        self.recorder.close()

    def digest_seconds(self) -> float:
        """The digest alone of what the last step recorded, as the recorder computes it in a
        repeated call: the tensors' addresses and one native call (without the library, the
        torch reference as `body_sums` runs it)."""
        start = time.perf_counter()
        for phase, named in self.last.items():
            if phase.startswith("global:"):
                global_body_sums([(n, t) for n, t in named if t is not None])
                continue
            # "both:": one rank, the local sums stand for the global ones too
            tensors = [t for _, t in named if t is not None]
            if _native.available() and tensors[0].device.type == "cpu":
                _native.body_sums_into([t.data_ptr() for t in tensors], array("Q", [t.nbytes for t in tensors]),
                                       self._sums.ctypes.data if len(self._sums) >= len(tensors)
                                       else self._grow_sums(len(tensors)))
            else:
                body_sums_of_checked(tensors, tensors[0].device)
        return time.perf_counter() - start

    def _grow_sums(self, n: int) -> int:
        self._sums = np.zeros(n, dtype=np.uint64)
        return self._sums.ctypes.data


def component_split(timed: _Timed, first_step: int, reps: int, rng: np.random.Generator) -> dict:
    """Per-step cost of each part of recording params+grads, in a tight loop on the tensors of
    the last recorded step: digest, then the recorder's calls (the same records as in training)."""
    parts: dict[str, list[float]] = {"record": [], "digest": [], "encode": [], "write": []}
    last = dict(timed.last)
    for rep in range(reps):
        step = first_step + rep
        digest = timed.digest_seconds()
        before = dict(timed.spent)
        for phase, named in last.items():
            if phase.startswith("global:"):
                timed.global_tensors(step, phase.removeprefix("global:"), named)
            elif phase.startswith("both:"):
                timed.tensors_and_global(step, phase.removeprefix("both:"), named)
            else:
                timed.tensors(step, phase, named)
        if timed.last_metrics is not None:
            timed.metrics(step, **timed.last_metrics)
        timed.end_step(step)
        parts["digest"].append(digest)
        parts["record"].append(timed.spent["record"] - before["record"] - digest)
        parts["encode"].append(timed.spent["encode"] - before["encode"])
        parts["write"].append(timed.spent["write"] - before["write"])
    return {part: bootstrap_median(np.array(v), rng) for part, v in parts.items()}


def _recorder(root: Path, **kwargs) -> samebits.Recorder:
    return samebits.Recorder(root, rank=0, world_size=1, **kwargs)


def bootstrap_median(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """The median of `values` and its 95% bootstrap interval."""
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))
    low, high = np.percentile(np.median(values[picks], axis=1), [2.5, 97.5])
    return float(np.median(values)), float(low), float(high)


def bootstrap_overhead(mode: np.ndarray, off: np.ndarray, rng: np.random.Generator) -> tuple[float, float, float]:
    """The median over blocks of mode / off - 1 (paired: the same block), with its 95% bootstrap
    interval.  A median of paired ratios: a load spike on one step moves it little."""
    return bootstrap_median(mode / off - 1, rng)


def run(blocks: int, seed: int, reps: int) -> dict:
    root = Path(tempfile.mkdtemp(prefix="samebits-bench-"))
    cfg = RecipeConfig()
    load_before = os.getloadavg()[0]
    try:
        with session(cfg):
            timed = _Timed(_recorder(root / "params+grads", phases="grads,params"))
            modes = {
                "off": None,
                "no-op recorder": _NoOpRecorder(),
                "digest only": _DigestOnly(),
                "params+grads": timed,
                "everything": _recorder(root / "everything"),
            }
            trainer = _Run(cfg, 0, 1)
            order = random.Random(seed)
            times = {mode: [] for mode in modes}
            cpu_times = {mode: [] for mode in modes}
            split = {"record": [], "digest": [], "encode": [], "write": []}
            for block in range(WARMUP_BLOCKS + blocks):
                names = list(modes)
                order.shuffle(names)
                for mode in names:
                    spent = dict(timed.spent)
                    cpu_start = time.process_time()
                    metrics, _ = trainer.train_step(modes[mode])
                    cpu = time.process_time() - cpu_start
                    trainer.step += 1
                    if block < WARMUP_BLOCKS:
                        timed.last = {}
                        continue
                    times[mode].append(metrics["step_time_s"])
                    cpu_times[mode].append(cpu)
                    if mode == "params+grads":
                        digest = timed.digest_seconds()
                        split["digest"].append(digest)
                        split["record"].append(timed.spent["record"] - spent["record"] - digest)
                        split["encode"].append(timed.spent["encode"] - spent["encode"])
                        split["write"].append(timed.spent["write"] - spent["write"])
                    # The wrapper's references to the step's tensors would keep this step's
                    # gradients alive through the next one's backward (a recorder keeps none).
                    timed.last = {}
            trainer.train_step(timed)  # one more step, unmeasured: its tensors for the tight loop
            trainer.step += 1
            rng = np.random.default_rng(seed)
            tight = component_split(timed, trainer.step, reps, rng)
            for recorder in modes.values():
                if recorder is not None:
                    recorder.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    off = np.array(times["off"])
    overhead = {mode: bootstrap_overhead(np.array(t), off, rng) for mode, t in times.items()
                if mode != "off" and blocks}  # --blocks 0: the tight-loop split alone
    cpu_off = np.array(cpu_times["off"])
    cpu_overhead = {mode: bootstrap_overhead(np.array(t), cpu_off, rng) for mode, t in cpu_times.items()
                    if mode != "off" and blocks}
    sum_ratio = {mode: float(np.sum(t) / np.sum(off) - 1) for mode, t in times.items() if mode != "off" and blocks}
    step_off = float(np.median(off)) if blocks else float("nan")
    return {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "blocks": blocks,
        "step_ms": {mode: 1e3 * float(np.median(t)) for mode, t in times.items() if blocks},
        "overhead": {mode: {"point": p, "ci95": [low, high]} for mode, (p, low, high) in overhead.items()},
        "overhead_of_summed_times": sum_ratio,
        "step_cpu_ms": {mode: 1e3 * float(np.median(t)) for mode, t in cpu_times.items() if blocks},
        "cpu_overhead": {mode: {"point": p, "ci95": [low, high]} for mode, (p, low, high) in cpu_overhead.items()},
        "params+grads_in_steps_ms": {part: 1e3 * float(np.median(v)) for part, v in split.items() if blocks},
        "params+grads_split_ms": {part: {"median": 1e3 * m, "ci95": [1e3 * low, 1e3 * high]}
                                  for part, (m, low, high) in tight.items()},
        "params+grads_split_pct_of_step": {part: 100 * m / step_off for part, (m, _, _) in tight.items()},
        "split_reps": reps,
        "load_average": [load_before, os.getloadavg()[0]],  # 1-minute, before and after
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=40,
                        help="measured blocks (one step per mode each); 0: only the tight-loop split")
    parser.add_argument("--seed", type=int, default=0, help="seeds the mode order and the bootstrap")
    parser.add_argument("--reps", type=int, default=300, help="tight-loop repetitions of the split")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.blocks, args.seed, args.reps)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['threads']} thread(s), {result['blocks']} blocks; wall = step time, cpu = process CPU time; "
          "load average {:.2f} before, {:.2f} after".format(*result["load_average"]))
    print(f"{'recording':<15} {'wall ms':>9} {'overhead':>9} {'95% CI':>20}  {'cpu ms':>9} {'overhead':>9} {'95% CI':>20}"
          f"  {'sum ratio':>9}")
    for mode, value in result["step_ms"].items():
        cpu = result["step_cpu_ms"][mode]
        if mode == "off":
            print(f"{mode:<15} {value:>9.2f} {'-':>9} {'':>20}  {cpu:>9.2f} {'-':>9}")
            continue
        o, c = result["overhead"][mode], result["cpu_overhead"][mode]
        interval = [f"[{100 * x['ci95'][0]:+.2f}%, {100 * x['ci95'][1]:+.2f}%]" for x in (o, c)]
        print(f"{mode:<15} {value:>9.2f} {100 * o['point']:>+8.2f}% {interval[0]:>20}  "
              f"{cpu:>9.2f} {100 * c['point']:>+8.2f}% {interval[1]:>20}  "
              f"{100 * result['overhead_of_summed_times'][mode]:>+8.2f}%")
    print("params+grads, time in the recorder during the steps (ms, medians): "
          + ", ".join(f"{part} {ms:.3f}" for part, ms in result["params+grads_in_steps_ms"].items()))
    print(f"params+grads split, tight loop of {result['split_reps']} steps' records (median ms [95% CI], "
          "% of the median off step):")
    for part, value in result["params+grads_split_ms"].items():
        print(f"  {part:<7} {value['median']:.3f} [{value['ci95'][0]:.3f}, {value['ci95'][1]:.3f}]  "
              f"{result['params+grads_split_pct_of_step'][part]:.2f}%")
    print("target: params+grads overhead < 2%")


if __name__ == "__main__":
    main()
