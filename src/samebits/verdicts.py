"""Verdicts and the exit codes they map to: one place for both.

A verdict is proof or nothing.  ``IDENTICAL``/``PASS`` are only ever given when every
byte that should have been compared was compared; a run that crashed, a stream that is
damaged or missing, or a window that compared nothing is ``INCOMPLETE`` (exit 2), never a
good verdict.  Members are strings, so ``result.verdict == "identical"`` and JSON output
keep working unchanged.
"""

from __future__ import annotations

import enum
import warnings

EXIT_OK, EXIT_BAD_VERDICT, EXIT_CANNOT_RUN = 0, 1, 2
# A step's result may come from a hardware fault (samebits.rerun: a transient fault, or a
# failed check that reproduces on this hardware): restart the job on other hardware.  The
# value Megatron's rerun state machine uses, so a scheduler can treat both alike.
EXIT_RERUN_ELSEWHERE = 16
# The live check (`samebits run --reference`, the recipe's --reference) stopped a run at its first
# step that differs from the reference run: the process, and `samebits run` around it, exit 3.
EXIT_STOPPED = 3


class Verdict(str, enum.Enum):
    """The outcome of a comparison or a check; ``exit_code`` is what the CLI returns."""

    IDENTICAL = "identical"  # every compared record equal, and something was compared
    DIVERGED = "diverged"  # a difference, with its evidence
    PASS = "pass"  # every guarantee checked held
    FAIL = "fail"  # a guarantee checked did not hold
    INCOMPLETE = "incomplete"  # could not decide: crashed run, damaged or missing data, empty window

    @property
    def exit_code(self) -> int:
        if self in (Verdict.IDENTICAL, Verdict.PASS):
            return EXIT_OK
        if self in (Verdict.DIVERGED, Verdict.FAIL):
            return EXIT_BAD_VERDICT
        return EXIT_CANNOT_RUN

    @property
    def good(self) -> bool:
        return self.exit_code == EXIT_OK

    def __str__(self) -> str:  # print the word, not "Verdict.IDENTICAL"
        return self.value


class ToDict:
    """The one serialiser name: results offer ``to_dict()`` (plain JSON-ready values).

    ``to_json()`` was the name in four packages until 2026-12; it stays as a deprecated alias.
    """

    def to_dict(self) -> dict:  # every subclass defines it
        raise NotImplementedError(f"{type(self).__name__} does not define to_dict()")

    def to_json(self) -> dict:
        warnings.warn(f"{type(self).__name__}.to_json() is deprecated: use to_dict()",
                      DeprecationWarning, stacklevel=2)
        return self.to_dict()


__all__ = ["Verdict", "ToDict", "EXIT_OK", "EXIT_BAD_VERDICT", "EXIT_CANNOT_RUN", "EXIT_RERUN_ELSEWHERE",
           "EXIT_STOPPED"]
