"""`samebits verify`: check the two guarantees by running the training three times.

* A and B: two independent runs from the same initial state must be bitwise identical
  at every step (guarantee 1).
* C: saves a checkpoint at step k, the process exits, a fresh process resumes and runs
  to the end; from step k on it must be bitwise identical to A (guarantee 2).

B and C check themselves live against A's step roots and stop at the first divergent
step, so no compute is spent after the answer is known.  The same check runs on the
built-in reference recipe or, through zero-code recording, on any command.
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from samebits._launch import failed, run_logged, teardown_note
from samebits.compare import DiffResult, diff
from samebits.errors import SamebitsError

STOPPED_MARKER = "stopped.json"  # the recipe leaves it when its live check stops the run


@dataclass
class VerifyResult:
    """``verdict`` is "pass" when every check is identical, else "fail"."""

    out: str
    checks: dict[str, DiffResult | None]
    timings: dict[str, float]
    resume_at: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        return "pass" if all(r is None or r.identical for r in self.checks.values()) else "fail"

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "out": self.out,
            "resume_at": self.resume_at,
            "checks": {name: (r.to_json() if r is not None else None) for name, r in self.checks.items()},
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            "notes": self.notes,
        }


def default_out_dir() -> Path:
    return Path("samebits-out") / time.strftime("verify-%Y%m%d-%H%M%S")


def _prepare(out) -> Path:
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise SamebitsError(f"{out} exists and is not empty: samebits never overwrites runs. "
                            "Pass a new --out directory or delete the old one.")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return out


def _recipe_argv(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "samebits.recipes.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "-m", "samebits.recipes.train"]


def verify_recipe(
    out=None,
    *,
    steps: int = 8,
    resume_at: int | None = None,
    nproc: int = 2,
    overrides: list[str] = (),
    nondeterministic: bool = False,
    progress: Callable[[str], None] | None = None,
) -> VerifyResult:
    """Run the reference recipe A, B and C (save at ``resume_at``, resume) and compare."""
    if steps < 2:
        raise SamebitsError(f"--steps {steps}: verify needs at least 2 steps (one before and one after the resume).")
    resume_at = steps // 2 if resume_at is None else resume_at
    if not 0 < resume_at < steps:
        raise SamebitsError(f"--resume-at {resume_at} must be between 1 and {steps - 1} (inside the run).")
    if nproc < 1:
        raise SamebitsError(f"--nproc {nproc} must be at least 1.")
    out = _prepare(out or default_out_dir())
    say = progress or (lambda message: None)
    base = _recipe_argv(nproc) + ["--steps", str(steps)]
    for item in overrides:
        base += ["--set", item]
    if nondeterministic:
        base += ["--preset", "nondeterministic"]
    stages = [
        ("A", base + ["--out", str(out / "a")], False),
        ("B", base + ["--out", str(out / "b"), "--reference", str(out / "a")], True),
        ("C (save)", base + ["--out", str(out / "c"), "--save-at", str(resume_at), "--ckpt", str(out / "ckpt")], False),
        ("C (resume)", base + ["--out", str(out / "c"), "--resume-from", str(out / "ckpt"), "--reference",
                               str(out / "a")], True),
    ]
    timings: dict[str, float] = {}
    notes: list[str] = []
    for index, (name, argv, may_stop) in enumerate(stages, 1):
        say(f"[{index}/{len(stages)}] run {name}: {nproc} rank(s), {steps} steps ...")
        run_dir = Path(argv[argv.index("--out") + 1])
        log = out / "logs" / (name.split()[0].lower() + ("-resume" if "resume" in name else "") + ".log")
        code, seconds = run_logged(argv, log, label=name)
        timings[name] = seconds
        # torchrun replaces the recipe's exit code 3 by its own: the marker file tells.
        stopped = may_stop and (run_dir / STOPPED_MARKER).exists()
        if code != 0 and not stopped:
            saved = "save" not in name or (out / "ckpt" / "latest").exists()
            note = teardown_note(name, code, run_dir, log) if saved else None
            if note is None:
                raise failed(name, argv, code, log)
            notes.append(note)
        say(f"      done in {seconds:.1f} s" + (" (stopped at its first divergent step)" if stopped else ""))
    say("comparing ...")
    checks = {
        "independent": diff(out / "a", out / "b"),
        "resume": diff(out / "a", out / "c", start_step=resume_at),
    }
    result = VerifyResult(str(out), checks, timings, resume_at, notes)
    _write_summary(out, result)
    return result


def verify_command(
    cmd: list[str],
    out=None,
    *,
    resume_with: str | None = None,
    resume_at: int | None = None,
    progress: Callable[[str], None] | None = None,
    steps: str | None = None,
) -> VerifyResult:
    """Run ``cmd`` twice with zero-code recording and compare; with ``resume_with`` (a
    command holding ``{step}``, run after A) also check a resumed run from ``resume_at``."""
    from samebits.autorecord import environment_for

    if not cmd:
        raise SamebitsError("no command given: write `samebits verify -- python train.py ...`.")
    if resume_with is not None and resume_at is None:
        raise SamebitsError("--resume-with needs --resume-at K: the step the resumed command starts from.")
    out = _prepare(out or default_out_dir())
    say = progress or (lambda message: None)
    command = shlex.join(cmd)
    stages = [("A", cmd, environment_for(out / "a", command=command, steps=steps)),
              ("B", cmd, environment_for(out / "b", command=command, steps=steps, reference=out / "a"))]
    if resume_with is not None:
        resumed = shlex.split(resume_with.replace("{step}", str(resume_at)))
        stages.append(("C (resume)", resumed,
                       environment_for(out / "c", command=command, steps=steps, step_offset=resume_at,
                                       reference=out / "a")))
    timings, notes = {}, []
    for index, (name, argv, env) in enumerate(stages, 1):
        say(f"[{index}/{len(stages)}] run {name}: {shlex.join(argv)}")
        log = out / "logs" / (name.split()[0].lower() + ".log")
        code, seconds = run_logged(argv, log, env=env, label=name)
        timings[name] = seconds
        if code != 0:
            note = teardown_note(name, code, Path(env["SAMEBITS_DIR"]), log)
            if note is None:
                raise failed(name, argv, code, log)
            notes.append(note)
        say(f"      done in {seconds:.1f} s")
    checks = {"independent": diff(out / "a", out / "b"),
              "resume": diff(out / "a", out / "c", start_step=resume_at) if resume_with else None}
    result = VerifyResult(str(out), checks, timings, resume_at, notes)
    _write_summary(out, result)
    return result


def _write_summary(out: Path, result: VerifyResult) -> None:
    import json

    (out / "summary.json").write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")


__all__ = ["verify_recipe", "verify_command", "VerifyResult"]
