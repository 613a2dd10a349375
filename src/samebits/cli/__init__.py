"""The `samebits` command line: parse, call one library function, print.

Each subcommand is a module of this package with ``register(subparsers)`` (adds its parser,
sets ``func``) and ``EXAMPLES`` (shown at the end of its --help); modules are discovered, so
adding a command is adding a file.  Building the parser loads no library (`samebits.cli._lazy`).
Exit codes: docs/cli.md (`samebits.verdicts`).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import pkgutil
import shlex
import shutil
import signal
import sys

import samebits
from samebits.cli._format import escape
from samebits.cli._options import refuse_recipe_options
from samebits.errors import SamebitsError
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

EXIT_INTERRUPTED = 128 + signal.SIGINT  # what a shell reports for Ctrl-C
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader of our output went away (`| head`)

_EXAMPLES_HEAD = "example(s):\n"


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that the examples at the end keep their lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(_EXAMPLES_HEAD):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def command_modules() -> list[str]:
    """The subcommands: one module each in this package (`register`)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="samebits",
        description="Make PyTorch training bitwise deterministic, and prove it.",
        epilog="exit codes: 0 good verdict, 1 bad verdict, 2 could not run or decide, 3 stopped by the live "
               "check; all of them: docs/cli.md. Each command's --help ends with an example.",
    )
    parser.add_argument("--version", action="version", version=f"samebits {samebits.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in command_modules():
        module = importlib.import_module(f"{__name__}.{name}")
        module.register(sub)
        # A command without examples still runs; tests/test_cli_help.py fails on it.
        examples = getattr(module, "EXAMPLES", "").splitlines()
        command = sub.choices[name]
        command.formatter_class = _HelpFormatter
        command.epilog = _EXAMPLES_HEAD + "\n".join(f"  {line}" for line in examples) if examples else None
    return parser


def unknown_command(argv: list[str], commands: list[str]) -> str | None:
    """The error for a first word that is no command (``samebits verfy``), with the closest ones."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    if word is None or word in commands or argv.index(word) != 0:
        return None
    close = difflib.get_close_matches(word, commands, n=2, cutoff=0.6)
    if not close and len(word) >= 2:
        close = [name for name in commands if name.startswith(word[:2])][:2]
    hint = f"did you mean {' or '.join(repr(name) for name in close)}? " if close else ""
    return f"unknown command {word!r}; {hint}`samebits --help` lists the commands"


def forgotten_separator(argv: list[str], parser: argparse.ArgumentParser) -> str | None:
    """The error for a program given without ``--`` before it (``samebits verify python train.py
    --out x``), which argparse would rob of the options samebits knows; it shows the fixed line.
    None when ``--`` comes first, the command takes no program, or an option is unknown."""
    index = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    commands = parser._subparsers._group_actions[0].choices
    if index is None or argv[index] not in commands:
        return None
    command = commands[argv[index]]
    if not any(action.dest == "cmd" and not action.option_strings for action in command._actions):
        return None  # its positionals are runs or packages, not a program
    words = argv[index + 1:]
    first = _first_positional(command, words)
    if first is None:
        return None
    program = next(action for action in command._actions if action.dest == "cmd")
    taken = [] if program.nargs == argparse.REMAINDER else \
        [word.split("=", 1)[0] for word in words[first:] if _option_action(command, word) is not None]
    fixed = shlex.join(["samebits", *argv[:index + 1], *words[:first], "--", *words[first:]])
    why = (f"without it, samebits takes {', '.join(dict.fromkeys(taken))} as its own option"
           f"{'s' if len(set(taken)) > 1 else ''} and your program never sees {'them' if len(set(taken)) > 1 else 'it'}"
           if taken else "everything after `--` is your command, as written; samebits' options go before it")
    return f"`{words[first]}` starts a command with no `--` before it: did you forget `--`? ({why}). Write:\n  {fixed}"


def _option_action(parser: argparse.ArgumentParser, word: str) -> argparse.Action | None:
    """The action ``word`` names (``--out``, ``--out=x``, an abbreviation); None if none."""
    if not word.startswith("-") or word == "-":
        return None
    name = word.split("=", 1)[0] if word.startswith("--") else word
    found = parser._option_string_actions.get(name)
    if found is None and name.startswith("--") and parser.allow_abbrev:
        close = [option for option in parser._option_string_actions if option.startswith(name)]
        found = parser._option_string_actions[close[0]] if len(close) == 1 else None
    return found


def _first_positional(parser: argparse.ArgumentParser, words: list[str]) -> int | None:
    """The index in ``words`` of the first positional (the program's first word), skipping options
    and their values as argparse does; None at ``--``, at an unknown option, or when none."""
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return None
        if not word.startswith("-") or word == "-":
            return i
        action = _option_action(parser, word)
        if action is None:
            return None
        i += 1
        if "=" in word or action.nargs == 0:
            continue
        if isinstance(action.nargs, int):
            i += action.nargs
        elif action.nargs is None:
            i += 1
        elif action.nargs == "?":
            i += 1 if i < len(words) and not words[i].startswith("-") else 0
        else:  # "*", "+": argparse takes every word up to the next option, a program's too
            first = i
            while i < len(words) and not words[i].startswith("-"):
                if i > first and _looks_like_a_program(words[i]):  # `--across dp=1,2 python train.py`
                    return i
                i += 1
    return None


def _looks_like_a_program(word: str) -> bool:
    """Whether ``word`` names a program or script (``python``, ``torchrun``, ``train.py``,
    ``./run.sh``), not a value such as a layout (``dp=1,2``, ``single,tp2``)."""
    return word.endswith((".py", ".sh")) or "/" in word or shutil.which(word) is not None


def _closest_options(parser: argparse.ArgumentParser, args: argparse.Namespace, extras: list[str]) -> str:
    """``; did you mean --resume-at?`` for a mistyped option of the command (or of samebits)."""
    command = parser._subparsers._group_actions[0].choices.get(getattr(args, "command", None) or "", parser)
    known = [option for action in command._actions for option in action.option_strings if option.startswith("--")]
    names = [word.split("=", 1)[0] for word in extras]
    hints = [f"{name}: did you mean {close[0]}?" for name in names
             if name.startswith("--") and (close := difflib.get_close_matches(name, known, n=1, cutoff=0.7))]
    return f" ({'; '.join(hints)})" if hints else ""


def main(argv: list[str] | None = None) -> int:
    _safe_output()
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    unknown = unknown_command(argv, command_modules())
    if unknown is not None:
        parser.print_usage(sys.stderr)
        print(f"samebits: error: {escape(unknown)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    forgotten = forgotten_separator(argv, parser)
    if forgotten is not None:  # before parsing: the options after the program word are not samebits'
        command = next(arg for arg in argv if not arg.startswith("-"))
        print(f"samebits {command}: error: {escape(forgotten, keep_newlines=True)}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    args, extras = parser.parse_known_args(argv)
    if extras:  # what argparse's parse_args refuses, with the closest options of the command
        parser.error(f"unrecognized arguments: {' '.join(extras)}{_closest_options(parser, args, extras)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_CANNOT_RUN
    try:
        refuse_recipe_options(args)
        code = int(args.func(args))
    except BrokenPipeError:
        # `samebits dump RUN | head`: the reader left mid-output; stop quietly.
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except (SamebitsError, OSError) as err:  # OSError: a file the command needed could not be read or written
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
    """A character a non-UTF-8 terminal cannot show is written as a backslash escape, never
    raised as UnicodeEncodeError."""
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


__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_BAD_VERDICT", "EXIT_CANNOT_RUN",
           "EXIT_INTERRUPTED", "EXIT_BROKEN_PIPE"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
