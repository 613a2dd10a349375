"""`run_recorded`: run any command with zero-code recording into a new run directory."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Callable

from samebits.autorecord import environment_for
from samebits.errors import ConfigError
from samebits.runners._launch import run_attached
from samebits.runners.commands import check_out_dir


def run_recorded(cmd: list[str], out, *, reference=None, step_offset: int | None = None,
                 progress: Callable[[str], None] | None = None, **what) -> int:
    """Run ``cmd`` with recording into ``out`` (new or empty); return its exit code.  ``reference``:
    check each step live against that run; ``what``: `samebits.autorecord.recording_variables`'
    arguments."""
    if not cmd:
        raise ConfigError("no command given: write `samebits run --out DIR -- python train.py ...`.")
    if step_offset is not None and step_offset < 0:
        raise ConfigError(f"--step-offset {step_offset}: must be >= 0.")
    check_out_dir(out)
    env = environment_for(out, command=shlex.join(cmd), reference=reference, step_offset=step_offset, **what)
    return run_attached(cmd, env=env, progress=progress, streams=Path(out))


__all__ = ["run_recorded"]
