"""The `samebits` command line: parse, call one library function, print.

Each subcommand lives in its own module in this package and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (taking the parsed
arguments, returning the exit code).  Modules are discovered, so adding a command is
adding a file.  Exit codes everywhere: 0 good verdict, 1 bad verdict, 2 could not run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import signal
import sys

from samebits.cli._format import escape
from samebits.errors import SamebitsError
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader of our output went away (`| head`)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="samebits",
        description="Make PyTorch training bitwise deterministic, and prove it.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    _safe_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CANNOT_RUN
    try:
        code = int(args.func(args))
    except BrokenPipeError:
        # `samebits dump RUN | head`: the reader left mid-output; stop quietly.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except SamebitsError as err:
        print(f"samebits {args.command}: error: {escape(err, keep_newlines=True)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except OSError as err:  # a file the command needed could not be read or written
        print(f"samebits {args.command}: error: {escape(err, keep_newlines=True)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM/SIGHUP during a run (its processes were ended)
        signum = getattr(err, "signum", signal.SIGINT)
        what = "interrupted" if signum == signal.SIGINT else f"terminated ({signal.Signals(signum).name})"
        print(f"samebits {args.command}: {what}", file=sys.stderr)
        return EXIT_INTERRUPTED if signum == signal.SIGINT else 128 + signum
    try:
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        _silence_stdout()  # the whole output was produced: the verdict's code still stands
    return code


def _safe_output() -> None:
    """A character the terminal's encoding cannot show is written as a backslash escape, never
    raised as UnicodeEncodeError (`escape` already makes every character of a file name or a
    record name visible and encodable as UTF-8; this covers a terminal that is not UTF-8)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")
        except (AttributeError, ValueError, OSError):  # not a text file of io (replaced, or closed)
            pass


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (captured): nothing to do
        pass


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
