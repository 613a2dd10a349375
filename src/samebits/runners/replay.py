"""`samebits replay RUN --step K --nproc N`: re-execute steps K..K+n of a recorded run on N
ranks, from its checkpoint at K, and compare with what the run recorded.

Only a run recorded with invariant gradient reduction is replayed (its bits do not depend on
the DP size; any other is refused: a difference would prove nothing).  The command template's
placeholders: ``{nproc}``, ``{out}``, ``{step}``, ``{stop}`` (K + n), ``{run}`` and ``{ckpt}``
(default RUN/ckpt or RUN/../ckpt); the reference recipe's is `samebits.cli._recipe.replay_config_at`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from samebits.compare import DiffResult
from samebits.errors import ConfigError, StreamError
from samebits.runners._launch import failed, run_logged
from samebits.runners.across import compare_replicated
from samebits.runners.commands import CKPT, NPROC, OUT, RUN, STEP, fill_placeholders, prepare_out_dir, write_summary
from samebits.runners.verify import RunInfo
from samebits.stream import open_run
from samebits.verdicts import ToDict, Verdict, milliseconds, serialised

STOP = "{stop}"  # the step the replay stops before
REPLAY_PLACEHOLDERS = (NPROC, OUT, STEP, STOP, RUN, CKPT)
INVARIANT_KEY, INVARIANT_VALUE = "grad_reduce", "invariant"


@dataclass
class ReplayResult(ToDict):
    """The replay's comparison with the recorded run over steps [step, stop)."""

    summary_of = "replay"  # its summary.json names the command that wrote it
    run: str
    out: str
    step: int
    stop: int
    nproc: int
    recorded_world_size: int
    dict_keys = ("verdict", "run", "out", "step", "stop", "nproc", "recorded_world_size", "check", "runs", "notes",
                 "timings_s")

    check: DiffResult
    runs: list[RunInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict, metadata=serialised(key="timings_s", convert=milliseconds))

    @property
    def verdict(self) -> Verdict:
        return Verdict(self.check.verdict)

    def dict_extras(self) -> dict:
        return {"verdict": self.verdict}


def recorded_steps(run_dir, rank: int = 0) -> list[int]:
    """The steps rank ``rank`` of a run recorded, in order."""
    return [block.step for block in open_run(run_dir).steps(rank)]


def replay(run_dir, *, step: int, cmd: Sequence[str], nproc: int = 1, num_steps: int = 1,
           recorded_config: Callable[[dict], Sequence[str]] | None = None, ckpt=None, out=None,
           run_timeout: float | None = None, progress: Callable[[str], None] | None = None) -> ReplayResult:
    """Re-run steps [step, step + num_steps) of ``run_dir`` on ``nproc`` ranks and compare.
    ``recorded_config``: words for the run's recorded config (the recipe's ``--set KEY=VALUE``),
    appended to ``cmd``; with them ``{ckpt}`` is the newest checkpoint at or before ``step``."""
    run_dir = Path(run_dir)
    if nproc < 1 or num_steps < 1:
        raise ConfigError(f"--nproc {nproc} and --num-steps {num_steps} must be at least 1")
    if not cmd:
        raise ConfigError("replay: no command to replay with; give --with 'CMD' (docs/invariance.md)")
    run = open_run(run_dir)
    header, world_size = run.header, run.world_size
    config = header.config
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
    if recorded_config is not None:
        ckpt = _checkpoint_at_or_before(ckpt, step)
    out = prepare_out_dir(out, "replay")
    record_dir = out / "replay"
    record_dir.mkdir()
    argv = fill_placeholders(cmd, {NPROC: nproc, OUT: record_dir, STEP: step, STOP: stop, RUN: run_dir, CKPT: ckpt})
    if recorded_config is not None:
        argv += list(recorded_config(config))
    say = progress or (lambda message: None)
    say(f"replaying steps {step}..{stop - 1} of {run_dir} (recorded on {world_size} ranks) on {nproc}: "
        f"{shlex.join(argv)}")
    log = out / "logs" / "replay.log"
    code, seconds = run_logged(argv, log, label="replay", timeout=run_timeout or 1800.0, progress=progress,
                               streams=record_dir)
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
    write_summary(out, result)
    return result


def _checkpoint_at_or_before(root: Path, step: int) -> Path:
    """The newest ``step-J`` folder of a checkpoint root with J <= ``step`` (a ``step-J`` folder
    itself as it is): the replay trains from J and compares from ``step`` on."""
    if root.name.startswith("step-") and root.is_dir():
        return root
    if not root.is_dir():
        raise ConfigError(f"no checkpoint folder {root}: replay resumes the run's checkpoint of a step at or before "
                          f"--step {step}. Pass --ckpt DIR (the root the run saved into), or make a run that saves "
                          "one: `samebits verify --across` on the recipe saves each size's checkpoint of step "
                          "steps/2 (and of its last step) into its folder's ckpt/ (a run made before this version saved "
                          "none: run it again)")
    saved = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit())
    usable = [s for s in saved if s <= step]
    if not usable:
        raise ConfigError(f"{root} holds checkpoints of steps {saved or 'none'}, none at or before --step {step}: "
                          f"replay a step from {saved[0]} on, or pass --ckpt DIR holding an earlier one"
                          if saved else f"{root} holds no checkpoint (no step-K folder): pass --ckpt DIR, the root "
                          "the run saved its checkpoints into")
    return root / f"step-{usable[-1]}"


def _default_ckpt(run_dir: Path) -> Path:
    for candidate in (run_dir / "ckpt", run_dir.parent / "ckpt"):
        if candidate.exists():
            return candidate
    return run_dir / "ckpt"


def _span(steps: list[int]) -> str:
    return "none" if not steps else f"{steps[0]}..{steps[-1]}"


__all__ = ["replay", "ReplayResult", "recorded_steps", "REPLAY_PLACEHOLDERS"]
