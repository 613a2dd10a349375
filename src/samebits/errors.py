"""The one exception hierarchy of samebits.

Every error a user can cause derives from `SamebitsError`; its message says what is
wrong, where (file, rank, step, tensor) and what to do next.  The CLI turns these into
a one-paragraph message and exit code 2 instead of a traceback.
"""

from __future__ import annotations


class SamebitsError(Exception):
    """Root of all samebits errors.  Catch this to handle any user-facing failure."""


class ConfigError(SamebitsError, ValueError):
    """A bad argument, option, environment value or config: the message names the setting,
    the value given, what is allowed and how to fix it.  Also a `ValueError`, so code that
    validates arguments the Python way keeps catching it."""


class StreamError(SamebitsError):
    """A fingerprint stream is missing, unreadable, truncated, corrupt or of another schema;
    the message names the file and where reading stopped."""


class IncomparableRunsError(SamebitsError):
    """Two runs cannot be compared (world size, schema, config, names); see `differences`."""

    def __init__(self, message: str, differences: list[str] | None = None):
        super().__init__(message)
        self.differences = list(differences or [])


class DeterminismError(SamebitsError):
    """A recipe or environment cannot run bitwise deterministically; `violations` holds every
    offending setting at once (fail closed)."""

    def __init__(self, message: str, violations: list | None = None):
        super().__init__(message)
        self.violations = list(violations or [])
