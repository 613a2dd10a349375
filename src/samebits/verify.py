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

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from samebits.compare import DiffResult, diff
from samebits.errors import SamebitsError

EXIT_STOPPED_AT_DIVERGENCE = 3  # the recipe's exit code when its live check fails
STOPPED_MARKER = "stopped.json"  # ... and the file it leaves, since torchrun hides that code


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


def _launch(argv: list[str], log: Path, env: dict | None = None) -> tuple[int, float]:
    start = time.perf_counter()
    with open(log, "w") as handle:
        handle.write("$ " + shlex.join(argv) + "\n")
        handle.flush()
        code = subprocess.call(argv, stdout=handle, stderr=subprocess.STDOUT, env=env)
    return code, time.perf_counter() - start


def _failed(name: str, code: int, log: Path) -> SamebitsError:
    tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
    return SamebitsError(f"run {name} exited with code {code}; the end of its log ({log}):\n{tail}")


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
        ("A", base + ["--out", str(out / "a")], {0}),
        ("B", base + ["--out", str(out / "b"), "--reference", str(out / "a")], {0, EXIT_STOPPED_AT_DIVERGENCE}),
        ("C (save)", base + ["--out", str(out / "c"), "--save-at", str(resume_at), "--ckpt", str(out / "ckpt")], {0}),
        ("C (resume)", base + ["--out", str(out / "c"), "--resume-from", str(out / "ckpt"), "--reference",
                               str(out / "a")], {0, EXIT_STOPPED_AT_DIVERGENCE}),
    ]
    timings: dict[str, float] = {}
    for index, (name, argv, ok_codes) in enumerate(stages, 1):
        say(f"[{index}/{len(stages)}] run {name}: {nproc} rank(s), {steps} steps ...")
        log = out / "logs" / (name.split()[0].lower() + ("-resume" if "resume" in name else "") + ".log")
        code, seconds = _launch(argv, log)
        timings[name] = seconds
        marker = Path(argv[argv.index("--out") + 1]) / STOPPED_MARKER
        stopped = code != 0 and EXIT_STOPPED_AT_DIVERGENCE in ok_codes and marker.exists()
        if code not in ok_codes and not stopped:
            raise _failed(name, code, log)
        stopped = " (stopped at its first divergent step)" if stopped or code == EXIT_STOPPED_AT_DIVERGENCE else ""
        say(f"      done in {seconds:.1f} s{stopped}")
    say("comparing ...")
    checks = {
        "independent": diff(out / "a", out / "b"),
        "resume": diff(out / "a", out / "c", start_step=resume_at),
    }
    result = VerifyResult(str(out), checks, timings, resume_at)
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
    timings = {}
    for index, (name, argv, env) in enumerate(stages, 1):
        say(f"[{index}/{len(stages)}] run {name}: {shlex.join(argv)}")
        log = out / "logs" / (name.split()[0].lower() + ".log")
        try:
            code, seconds = _launch(argv, log, env)
        except FileNotFoundError:
            raise SamebitsError(f"cannot run {argv[0]!r}: no such program. Check the command.") from None
        timings[name] = seconds
        if code != 0:
            raise _failed(name, code, log)
        say(f"      done in {seconds:.1f} s")
    checks = {"independent": diff(out / "a", out / "b"),
              "resume": diff(out / "a", out / "c", start_step=resume_at) if resume_with else None}
    result = VerifyResult(str(out), checks, timings, resume_at)
    _write_summary(out, result)
    return result


def _write_summary(out: Path, result: VerifyResult) -> None:
    import json

    (out / "summary.json").write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")


__all__ = ["verify_recipe", "verify_command", "VerifyResult"]
