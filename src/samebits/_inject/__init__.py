"""Code injection into every Python process a user's command starts: this folder first on
``PYTHONPATH``, whose ``sitecustomize`` runs the one it shadows, then zero-code recording
(``SAMEBITS_AUTORECORD=1``) or the probe (``SAMEBITS_PROBE_DIR``).
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
