"""Option groups and argparse types shared by several commands: one definition each, so every
command spells, documents, defaults and checks an option the same way.  Paths are checked here,
before the library (and torch, seconds) loads, so a mistyped path is refused at once.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from pathlib import Path
from typing import Callable

from samebits.cli._format import escape
from samebits.cli._lazy import lazy
from samebits.errors import ConfigError
from samebits.defaults import DEFAULT_TIMEOUT_S
from samebits.settings import RecordingSpec

Progress = lazy("samebits.runners.progress", "Progress")

MAX_COUNT = 10**9  # steps, pairs, ...: a count above this is a typo, not a run
MAX_NPROC = 1024  # processes of one run on one machine (--nproc, a matrix cell's world size)


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:  # also "1e30", "1.5" and numbers of more than 4300 digits
        return None


def int_range(low: int, high: int, example: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high``."""
    def check(text: str) -> int:
        value = _integer(text)
        if value is None or not low <= value <= high:
            wanted = {0: "a non-negative integer", 1: "a positive integer"}.get(low, f"an integer from {low:,}")
            raise argparse.ArgumentTypeError(f"give {wanted} up to {high:,}, e.g. {example}; got {text!r}")
        return value

    return check


positive_int = int_range(1, MAX_COUNT, 2)  # a count
step_number = int_range(0, MAX_COUNT, 3)  # a step, a rank or an offset
rank_count = int_range(1, MAX_NPROC, 2)  # processes of one run


def float_between(low: float, high: float, wanted: str, example: str) -> Callable[[str], float]:
    """An argparse ``type``: a number strictly between ``low`` and ``high`` (never nan)."""
    def check(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not low < value < high:  # also rejects nan
            raise argparse.ArgumentTypeError(f"give {wanted}, e.g. {example}; got {text!r}")
        return value

    return check


positive_float = float_between(0, math.inf, "a positive number", "600")  # timeouts, ratios
open_unit_interval = float_between(0, 1, "a number strictly between 0 and 1", "0.95")  # a confidence, a coverage


# -- inputs: what a command reads must be a regular file -------------------------------------------

_KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))
_READ_SUFFIXES = (".sbs", ".json")  # the files samebits reads in a run or output directory


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, from its ``st_mode``: "a FIFO (named pipe)", ..."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_input_file(path: str | os.PathLike, what: str) -> None:
    """Raise `ConfigError` when ``path`` exists but is not a regular file: a FIFO blocks the
    reader, a device never ends.  A missing path is left to the reader's own words."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return
    if not stat.S_ISREG(mode):
        raise ConfigError(f"{path}: {file_kind(mode)}, not a regular file; expected {what}.")


def check_input_directory(path: str | os.PathLike, depth: int = 0) -> None:
    """Refuse a ``path`` that is missing, no directory, or (``depth`` 0: a run directory) holds
    no stream; then `check_input_file` each stream and JSON file in it and, ``depth`` levels
    down, in its subdirectories (an output directory's runs, stages and cells)."""
    path = Path(path)
    what = "run directory" if depth == 0 else "directory"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        give = ("give the folder a run was recorded into (`samebits run --out DIR`, the Recorder's directory, or "
                "a run of an output folder such as samebits-out/verify-TIME/a)" if depth == 0 else
                "give the output directory of samebits verify, bisect or matrix, or two run directories")
        raise ConfigError(f"{path}: no such {what}; {give}.") from None
    except (OSError, ValueError):
        return
    if not stat.S_ISDIR(mode):
        kind = "a file" if stat.S_ISREG(mode) else file_kind(mode)
        raise ConfigError(f"{path}: {kind}, not a directory; pass the {what} holding rank-NNNNN.sbs files"
                          + ("." if depth == 0 else " (or the output directory of verify, bisect or matrix)."))
    try:
        entries = list(os.scandir(path))
    except (OSError, ValueError):
        return
    if depth == 0 and not any(_STREAM_NAME.match(entry.name) for entry in entries):
        runs = sorted(entry.name for entry in entries if _holds_streams(path / entry.name))
        hint = (f" It holds the run{'s' if len(runs) > 1 else ''} {', '.join(runs)}: give one, e.g. {path / runs[0]}."
                if runs else " Was the run recorded with samebits (Recorder, `samebits run --out DIR`, or "
                "SAMEBITS_DIR)?")
        raise ConfigError(f"{path}: no fingerprint streams (rank-NNNNN.sbs) in this directory.{hint}")
    for entry in sorted(entries, key=lambda e: e.name):
        if entry.name.endswith(_READ_SUFFIXES):
            check_input_file(path / entry.name, "a fingerprint stream (rank-NNNNN.sbs, as samebits wrote it)"
                             if entry.name.endswith(".sbs") else "a JSON file, as samebits wrote it")
        elif depth > 0:
            try:
                subdirectory = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            if subdirectory:
                check_input_directory(path / entry.name, depth - 1)


_STREAM_NAME = re.compile(r"^rank-\d{5,}\.sbs$")  # samebits.stream.reader's name of a rank's stream


def _holds_streams(path: Path) -> bool:
    """Whether ``path`` is a directory holding a rank's stream (a run of an output directory)."""
    try:
        return path.is_dir() and any(_STREAM_NAME.match(entry.name) for entry in os.scandir(path))
    except OSError:
        return False


def check_out_directory(out: str | os.PathLike | None, option: str = "--out") -> None:
    """Refuse an output folder that is a file or not empty (samebits never writes over runs),
    without importing torch; `samebits.runners.commands.check_out_dir` checks again later."""
    if out is None:
        return
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{option} {out} is a file, not a directory: give a new directory to write into.")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"{option} {out} exists and is not an empty directory (it may hold an earlier run): "
                          f"samebits never overwrites runs. Pass a new {option} directory or delete the old one.")


def add_recipe_options(parser: argparse.ArgumentParser, *, steps: int, nproc: int | None = None,
                       nondeterministic: bool = False) -> None:
    """The reference recipe's ``--steps``, ``--nproc``, ``--set`` and ``--nondeterministic``; each
    one given is noted in ``args.recipe_options_given`` for `refuse_recipe_options`."""
    group = parser.add_argument_group("the reference recipe (when no command is given)")
    group.add_argument("--steps", type=positive_int, default=steps, metavar="N", action=_noted(_StoreAction),
                       help=f"recipe: training steps per run (default {steps})")
    if nproc is not None:
        group.add_argument("--nproc", type=rank_count, default=nproc, metavar="N", action=_noted(_StoreAction),
                           help=f"recipe: ranks (default {nproc})")
    group.add_argument("--set", dest="overrides", action=_noted(_AppendAction), default=[], metavar="KEY=VALUE",
                       help="recipe: override one config field, e.g. --set seed=3 (repeatable)")
    if nondeterministic:
        group.add_argument("--nondeterministic", action=_noted(_StoreTrueAction),
                           help="recipe: its nondeterministic path (index_put_ accumulate, 2 threads), which "
                                "must be caught")


_StoreAction, _AppendAction, _StoreTrueAction = argparse._StoreAction, argparse._AppendAction, argparse._StoreTrueAction


def _noted(action: type[argparse.Action]) -> type[argparse.Action]:
    """argparse's ``action`` that also notes the option in ``recipe_options_given``."""
    class Noted(action):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            given = getattr(namespace, "recipe_options_given", [])
            setattr(namespace, "recipe_options_given", given + [option_string] if option_string not in given else given)

    return Noted


def refuse_recipe_options(args: argparse.Namespace) -> None:
    """Raise `ConfigError` when a recipe option (`add_recipe_options`) was given with a command of
    the user's (after ``--``, or ``--a``/``--b``): it would be ignored, the command runs as written."""
    given = getattr(args, "recipe_options_given", None)
    command = getattr(args, "cmd", None) or getattr(args, "cmd_a", None) or getattr(args, "cmd_b", None)
    if not given or not command:
        return
    raise ConfigError(f"{', '.join(given)}: {'options' if len(given) > 1 else 'an option'} of the reference recipe, "
                      "which runs only when no command is given; your command runs as written, so set its steps, "
                      "ranks and config in the command itself (e.g. -- torchrun --nproc-per-node 2 train.py "
                      "--steps 10), and drop " + ("them" if len(given) > 1 else "it") + ".")


def add_stop_after_option(parser: argparse.ArgumentParser, what: str = "end every run after this step (long "
                          "commands)") -> None:
    """``--stop-after STEP`` (from 0): where a program is ended; ``--steps`` is the recipe's count."""
    parser.add_argument("--stop-after", type=step_number, default=None, metavar="STEP", help=what)


def add_out_option(parser: argparse.ArgumentParser, command: str) -> None:
    """``--out DIR``: where the runs, logs and summary.json go (default samebits-out/COMMAND-TIME)."""
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"output directory (default: samebits-out/{command}-TIME)")


def add_run_timeout_option(parser: argparse.ArgumentParser,
                           what: str = "kill a run that takes longer and report a hang") -> None:
    """``--run-timeout SECONDS`` (default the library's, `samebits.defaults.DEFAULT_TIMEOUT_S`);
    ``what`` says what is killed, for a command whose runs are not all timed."""
    parser.add_argument("--run-timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"{what} (default {DEFAULT_TIMEOUT_S:g})")


def add_recording_options(parser: argparse.ArgumentParser) -> None:
    """One option per `samebits.settings.RecordingSpec` field; the step window is ``--record-steps``."""
    RecordingSpec.add_to_argparse(parser, flags={"steps": "--record-steps"})


def recording_options(args: argparse.Namespace) -> dict:
    """The parsed group as keyword arguments of `samebits.autorecord.recording_variables`."""
    return {"spec": RecordingSpec.from_args(args)}


# -- live progress: -q, --stall-factor (verify, bisect, matrix, tax, run) ---------------------------

STALL_FACTOR_HELP = "10"  # samebits.runners.progress.STALL_FACTOR, written here so that --help loads no library
MIN_STALL_HELP = "30"  # samebits.runners.progress.MIN_STALL_S


def add_progress_options(parser: argparse.ArgumentParser) -> None:
    """``-q/--quiet`` and ``--stall-factor N``, for a command that launches training runs."""
    group = parser.add_argument_group("progress (on stderr)")
    group.add_argument("-q", "--quiet", action="store_true",
                       help="print no progress: no stage lines and no live step lines (a stalled run is still "
                            "reported)")
    group.add_argument("--stall-factor", type=positive_float, default=None, metavar="N",
                       help=f"report a run that writes no step for N times its median step time, and at least "
                            f"{MIN_STALL_HELP} s (default {STALL_FACTOR_HELP})")


def progress_for(args: argparse.Namespace):
    """The `samebits.runners.progress.Progress` for `add_progress_options`' options, terminal-safe."""
    options = {} if args.stall_factor is None else {"stall_factor": args.stall_factor}
    return Progress(quiet=args.quiet, clean=lambda text: escape(text, keep_newlines=True), **options)
