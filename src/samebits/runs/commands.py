"""Command templates and output folders: what every runner of `samebits.runs` shares.

A runner takes the training command as argv with placeholders and fills them per run, so the
library never spells a program's own command line (the reference recipe's is built by
`samebits.recipes.commands`, and the command line composes the two).  Placeholders:

    {out}        the folder a run records into (a program that records itself), or its own
                 work folder (a command under zero-code recording)
    {run}        the run's name (a, b, c, dp2, ...)
    {step}       a step: where a run saves its checkpoint, or where a resumed run starts
    {from}       the work folder of the run a resumed command resumes (verify's A)
    {ckpt}       a checkpoint root
    {reference}  a recorded run to check each step against, live
    {nproc}      the number of ranks (processes) of one run

`SelfRecording` holds the templates of a program that records its own streams (the recipe:
``--out``, ``--save-at``, ``--resume-from``, ``--reference`` are its flags, not samebits').
Every runner writes into a new or empty output folder (`prepare_out_dir`, default
`default_out_dir`) and leaves its result there as summary.json (`write_summary`).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from samebits.errors import ConfigError, SamebitsError

OUT, RUN, STEP, FROM, CKPT, REFERENCE, NPROC = "{out}", "{run}", "{step}", "{from}", "{ckpt}", "{reference}", "{nproc}"
PLACEHOLDERS = (OUT, RUN, STEP, FROM, CKPT, REFERENCE, NPROC)
CHECK_TIMEOUT_S = 300.0  # a program's own option check trains nothing: minutes mean something hangs


class RecipeRefused(ConfigError):
    """The program refused its options or config (``said``: its own message) before any run."""

    def __init__(self, said: str):
        super().__init__(f"the recipe refuses these options, before any run: {said}")
        self.said = said


@dataclass(frozen=True)
class SelfRecording:
    """A training program that records its own fingerprint streams, as command templates.

    Each template is argv with placeholders (see the module docstring); a runner fills them
    with `fill_placeholders` and appends nothing of its own.  ``steps`` and ``nproc`` say what
    one run is (a runner checks its step arguments against ``steps`` and reports ``nproc``).
    """

    steps: int
    nproc: int
    record: tuple[str, ...]  # train ``steps`` steps, recording into {out}
    save: tuple[str, ...]  # the same, also saving its checkpoint of step {step} into {ckpt} on the way
    save_only: tuple[str, ...]  # train to step {step}, save its checkpoint into {ckpt} and exit (records nothing)
    resume: tuple[str, ...]  # resume the checkpoint {ckpt} and train to ``steps``, recording into {out}
    live_check: tuple[str, ...] = ()  # words that make a recording run check each step against {reference}
    check: tuple[str, ...] | None = None  # checks the options, trains nothing: non-zero exit refuses them
    bisect_words: tuple[str, ...] = ()  # the `samebits bisect` command of the same program (verify's hint)

    def __post_init__(self):
        if self.steps < 1 or self.nproc < 1:
            raise ConfigError(f"a run of {self.steps} step(s) on {self.nproc} rank(s): both must be at least 1.")
        for name in ("record", "save", "resume"):
            if not any(OUT in part for part in getattr(self, name)):
                raise ConfigError(f"the {name} command of a program that records itself has no {OUT} (where it "
                                  f"records): {shlex.join(getattr(self, name))}")

    def refuse_early(self) -> None:
        """Run ``check`` (if any) and raise `RecipeRefused` with the program's own last line of
        complaint when it exits non-zero: a config it refuses is refused before any run."""
        if self.check is None:
            return
        try:
            proc = subprocess.run(list(self.check), capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SamebitsError(f"checking the program's options did not finish ({shlex.join(self.check)})") from None
        except FileNotFoundError:
            raise SamebitsError(f"cannot run {self.check[0]!r}: no such program") from None
        if proc.returncode != 0:
            said = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            raise RecipeRefused(said[-1] if said else f"exit code {proc.returncode}")


def fill_placeholders(argv: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """``argv`` with each placeholder (a key of ``values``, e.g. ``"{out}"``) replaced by its
    value, inside words too (``--out={out}/a``)."""
    filled = []
    for part in argv:
        for placeholder, value in values.items():
            part = part.replace(placeholder, str(value))
        filled.append(part)
    return filled


def holds(argv: Sequence[str], placeholder: str) -> bool:
    """Whether a word of ``argv`` holds ``placeholder``."""
    return any(placeholder in part for part in argv)


def default_out_dir(kind: str) -> Path:
    """samebits-out/KIND-YYYYMMDD-HHMMSS: where a runner writes when given no folder."""
    return Path("samebits-out") / time.strftime(f"{kind}-%Y%m%d-%H%M%S")


def check_out_dir(out) -> Path:
    """Refuse, before anything starts, an ``out`` that is a file or holds anything: samebits
    never writes over runs."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: give a new directory to write into.")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not an empty directory (it may hold an earlier run): samebits "
                          "never overwrites runs. Pass a new --out directory or delete the old one.")
    return out


def prepare_out_dir(out, kind: str) -> Path:
    """The output folder of a runner (``out``, or `default_out_dir` of ``kind``), checked to be
    new or empty, created with its logs/ folder."""
    out = check_out_dir(out if out is not None else default_out_dir(kind))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    return out


def write_summary(out: Path, result, name: str = "summary.json") -> Path:
    """``result.to_dict()`` as indented JSON in ``out``/``name``; returns the file."""
    path = Path(out) / name
    path.write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n")
    return path


__all__ = ["SelfRecording", "RecipeRefused", "fill_placeholders", "holds", "default_out_dir", "check_out_dir",
           "prepare_out_dir", "write_summary", "PLACEHOLDERS", "OUT", "RUN", "STEP", "FROM", "CKPT", "REFERENCE",
           "NPROC"]
