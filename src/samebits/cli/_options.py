"""Option groups shared by several commands: one definition each, so every command that
takes an option spells, documents, defaults and checks it the same way.

* `add_recording_options`: what to record (`run`, `verify`);
* `add_recipe_options`: the reference recipe's size and config (`verify`, `bisect`, `tax`, `matrix`);
* `add_out_option`, `add_run_timeout_option`: where a command that launches runs writes, and
  how long one run may take;
* `positive_int`, `positive_float`: argparse types that reject 0 and negatives with a sentence.
"""

from __future__ import annotations

import argparse

from samebits.runs._launch import DEFAULT_TIMEOUT_S


def positive_int(text: str) -> int:
    """argparse ``type``: an integer >= 1 (argparse names the option in the error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"give a positive integer, e.g. 2; got {text!r}")
    return value


def positive_float(text: str) -> float:
    """argparse ``type``: a number > 0 (argparse names the option in the error)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"give a positive number, e.g. 600; got {text!r}")
    return value


def add_recipe_options(parser: argparse.ArgumentParser, *, steps: int, nproc: int | None = None,
                       nondeterministic: bool = False) -> None:
    """The reference recipe's options, for a command that runs it when given no command of the
    user's: ``--steps`` (default ``steps``), ``--nproc`` (when ``nproc`` is given: its default),
    ``--set KEY=VALUE`` (``args.overrides``) and, with ``nondeterministic``, the recipe's
    nondeterministic path, which the command must catch."""
    parser.add_argument("--steps", type=positive_int, default=steps, metavar="N",
                        help=f"recipe: training steps per run (default {steps})")
    if nproc is not None:
        parser.add_argument("--nproc", type=positive_int, default=nproc, metavar="N",
                            help=f"recipe: ranks (default {nproc})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="recipe: override one config field, e.g. --set seed=3 (repeatable)")
    if nondeterministic:
        parser.add_argument("--nondeterministic", action="store_true",
                            help="recipe: its nondeterministic path (index_put_ accumulate, 2 threads), which "
                                 "must be caught")


def add_out_option(parser: argparse.ArgumentParser, command: str) -> None:
    """``--out DIR``: where the runs, logs and summary.json go (default samebits-out/COMMAND-TIME)."""
    parser.add_argument("--out", default=None, metavar="DIR",
                        help=f"output directory (default: samebits-out/{command}-TIME)")


def add_run_timeout_option(parser: argparse.ArgumentParser,
                           what: str = "kill a run that takes longer and report a hang") -> None:
    """``--run-timeout SECONDS`` (default the library's, `samebits.runs._launch.DEFAULT_TIMEOUT_S`);
    ``what`` says what is killed, for a command whose runs are not all timed."""
    parser.add_argument("--run-timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"{what} (default {DEFAULT_TIMEOUT_S:g})")


def add_recording_options(parser: argparse.ArgumentParser, *, steps_flag: str = "--steps") -> None:
    """What to record (the SAMEBITS_* recording settings, docs/settings.md), as options.

    ``steps_flag``: the option naming the step window (`verify` and `bisect` use ``--steps`` for
    the number of training steps, so they call it ``--record-steps``)."""
    group = parser.add_argument_group("what to record")
    group.add_argument(steps_flag, dest="record_steps", default=None, metavar="START:STOP",
                       help="record only steps START <= step < STOP (either may be empty)")
    group.add_argument("--ranks", default=None, metavar="LIST", help="record only these ranks, e.g. 0,2-3")
    group.add_argument("--phases", default=None, metavar="LIST",
                       help="record only these phases, e.g. grads,params (samebits show RUN --records lists them)")
    group.add_argument("--include", action="append", default=None, metavar="GLOB",
                       help="record only tensors whose phase/name or name matches, e.g. 'params/*' or "
                            "'*.router.*' (repeatable)")
    group.add_argument("--exclude", action="append", default=None, metavar="GLOB",
                       help="do not record tensors matching this glob, e.g. 'optimizer/*' (repeatable; "
                            "applied after --include)")
    group.add_argument("--max-tensor-bytes", type=_positive_bytes, default=None, metavar="N",
                       help="tensors larger than N bytes (N >= 1) keep shape and dtype but no digest: their values "
                            "are not compared, so a comparison that meets one is INCOMPLETE")


def _positive_bytes(text: str) -> int:
    """--max-tensor-bytes: a positive number of bytes (0 or less would cap every tensor)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive number of bytes (the size cap must be >= 1; "
                                         "leave the option out to digest every tensor)")
    return value


def recording_options(args: argparse.Namespace) -> dict:
    """The parsed group as keyword arguments of `samebits.autorecord.recording_variables`."""
    return {"steps": args.record_steps, "ranks": args.ranks, "phases": args.phases, "include": args.include,
            "exclude": args.exclude, "max_tensor_bytes": args.max_tensor_bytes}
