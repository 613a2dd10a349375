"""Code injection into every Python process a user's command starts.

`samebits run`, `verify -- CMD`, `bisect -- CMD` and `probe -- CMD` run the command as the
user wrote it (its own interpreter, launchers such as torchrun, every rank) with this
folder first on ``PYTHONPATH``: its ``sitecustomize`` runs the environment's own
sitecustomize it shadows, then starts whichever samebits feature the environment asks for
(``SAMEBITS_AUTORECORD=1``: zero-code recording; ``SAMEBITS_PROBE_DIR``: the probe).
"""

from __future__ import annotations

import os
from pathlib import Path

INJECT_DIR = Path(__file__).resolve().parent
_PACKAGE_ROOT = INJECT_DIR.parent.parent  # so the child imports this samebits, installed or not


def with_injection(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the injection folder (and this samebits) first on ``PYTHONPATH``."""
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(INJECT_DIR), str(_PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    return env
