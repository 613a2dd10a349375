"""`samebits replay RUN --step K --nproc N`: re-execute steps K..K+n of a recorded run on N
ranks, from its checkpoint at K, and compare with what the run recorded.

A run trained with invariant gradient reduction (`samebits.invariant`) has bits that do not
depend on how many ranks shared the batch, so a step of a run on many ranks can be replayed
on a few (or one) and must give the same replicated records (parameters, reduced gradients,
global metrics) as the original.  A run that was not recorded in invariant mode (its stream
config has no ``grad_reduce: invariant``) is refused: its bits depend on its DP size, so a
difference would prove nothing.

Without a command, the reference recipe resumes from ``--ckpt`` (default RUN/../ckpt or
RUN/ckpt) with the run's recorded config.  With a command, these placeholders are filled:
``{nproc}`` (N), ``{out}`` (the replay's record folder), ``{step}`` (K), ``{stop}`` (K + n,
the step to stop before), ``{run}`` (RUN) and ``{ckpt}`` (the checkpoint folder).
"""

from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from samebits.compare import DiffResult
from samebits.errors import ConfigError, StreamError
from samebits.runs._launch import failed, run_logged
from samebits.runs.across import compare_replicated
from samebits.runs.verify import RunInfo, _fill, _prepare, _recipe_argv
from samebits.stream import open_run
from samebits.verdicts import ToDict, Verdict

REPLAY_PLACEHOLDERS = ("{nproc}", "{out}", "{step}", "{stop}", "{run}", "{ckpt}")
INVARIANT_KEY, INVARIANT_VALUE = "grad_reduce", "invariant"


@dataclass
class ReplayResult(ToDict):
    """The replay's comparison with the recorded run over steps [step, stop)."""

    run: str
    out: str
    step: int
    stop: int
    nproc: int
    recorded_world_size: int
    check: DiffResult
    runs: list[RunInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def verdict(self) -> Verdict:
        return Verdict(self.check.verdict)

    def to_dict(self) -> dict:
        return {"verdict": self.verdict.value, "run": self.run, "out": self.out, "step": self.step,
                "stop": self.stop, "nproc": self.nproc, "recorded_world_size": self.recorded_world_size,
                "check": self.check.to_dict(), "runs": [r.to_dict() for r in self.runs], "notes": self.notes,
                "timings_s": {k: round(v, 3) for k, v in self.timings.items()}}


def recorded_steps(run_dir, rank: int = 0) -> list[int]:
    """The steps rank ``rank`` of a run recorded, in order."""
    run = open_run(run_dir)
    try:
        return [block.step for block in run.stream(rank).steps()]
    finally:
        run.close()


def replay(run_dir, *, step: int, nproc: int = 1, num_steps: int = 1, cmd: list[str] | None = None,
           ckpt=None, out=None, run_timeout: float | None = None,
           progress: Callable[[str], None] | None = None) -> ReplayResult:
    """Re-run steps [step, step + num_steps) of ``run_dir`` on ``nproc`` ranks and compare."""
    run_dir = Path(run_dir)
    if nproc < 1 or num_steps < 1:
        raise ConfigError(f"--nproc {nproc} and --num-steps {num_steps} must be at least 1")
    run = open_run(run_dir)
    header, world_size = run.header, run.world_size
    run.close()
    config = header.get("config") or {}
    if config.get(INVARIANT_KEY) != INVARIANT_VALUE:
        raise ConfigError(
            f"{run_dir} was not recorded in invariant mode (its config has {INVARIANT_KEY}="
            f"{config.get(INVARIANT_KEY)!r}, not {INVARIANT_VALUE!r}): its bits depend on its data-parallel "
            f"size ({world_size}), so a replay on {nproc} ranks could differ without proving anything. Record "
            f"the run with {INVARIANT_KEY}={INVARIANT_VALUE} (docs/invariance.md), or replay on {world_size} ranks "
            "with `samebits verify --resume-with`.")
    steps = recorded_steps(run_dir)
    stop = step + num_steps
    missing = [s for s in range(step, stop) if s not in steps]
    if missing:
        raise ConfigError(f"--step {step} --num-steps {num_steps}: {run_dir} holds no record of step "
                          f"{missing[0]} (rank 0 recorded steps {_span(steps)}); pick steps it recorded")
    ckpt = Path(ckpt) if ckpt is not None else _default_ckpt(run_dir)
    out = _prepare(out or Path("samebits-out") / time.strftime("replay-%Y%m%d-%H%M%S"))
    record_dir = out / "replay"
    record_dir.mkdir()
    if cmd:
        argv = _fill(list(cmd), {"{nproc}": str(nproc), "{out}": str(record_dir), "{step}": str(step),
                                 "{stop}": str(stop), "{run}": str(run_dir), "{ckpt}": str(ckpt)})
    else:
        if not ckpt.exists():
            raise ConfigError(f"no checkpoint folder {ckpt}: pass --ckpt DIR, the folder the run saved its "
                              f"checkpoint of step {step} into")
        argv = _recipe_argv(nproc) + ["--steps", str(stop), "--resume-from", str(ckpt), "--out", str(record_dir)]
        # The recorded config as overrides; values that are not scalars are annotations the
        # recipe adds to its record (e.g. the resolved mesh), not settings.
        argv += [item for key, value in sorted(config.items()) if value is None or isinstance(value, (str, int, float))
                 for item in ("--set", f"{key}={_text(value)}")]
    say = progress or (lambda message: None)
    say(f"replaying steps {step}..{stop - 1} of {run_dir} (recorded on {world_size} ranks) on {nproc}: "
        f"{shlex.join(argv)}")
    log = out / "logs" / "replay.log"
    code, seconds = run_logged(argv, log, label="replay", timeout=run_timeout or 1800.0)
    info = RunInfo("replay", shlex.join(argv), code, seconds)
    if code != 0:
        raise failed("replay", argv, code, log)
    say("comparing the replay with the recorded run (rank 0's replicated records)")
    try:
        check = compare_replicated(run_dir, record_dir, start_step=step, stop_step=stop)
    except StreamError as err:
        raise StreamError(f"the replay finished but its records cannot be read: {err}") from None
    result = ReplayResult(run=str(run_dir), out=str(out), step=step, stop=stop, nproc=nproc,
                          recorded_world_size=world_size, check=check, runs=[info],
                          timings={"replay": seconds})
    (out / "summary.json").write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return result


def _default_ckpt(run_dir: Path) -> Path:
    for candidate in (run_dir / "ckpt", run_dir.parent / "ckpt"):
        if candidate.exists():
            return candidate
    return run_dir / "ckpt"


def _text(value) -> str:
    return "none" if value is None else str(value)


def _span(steps: list[int]) -> str:
    return "none" if not steps else f"{steps[0]}..{steps[-1]}"


__all__ = ["replay", "ReplayResult", "recorded_steps", "REPLAY_PLACEHOLDERS"]
