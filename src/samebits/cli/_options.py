"""Option groups shared by several commands: one definition each, so `run`, `verify` and
`bisect` spell, document and parse them the same way."""

from __future__ import annotations

import argparse


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
    group.add_argument("--max-tensor-bytes", type=int, default=None, metavar="N",
                       help="tensors larger than N bytes keep shape and dtype but no digest")


def recording_options(args: argparse.Namespace) -> dict:
    """The parsed group as keyword arguments of `samebits.autorecord.recording_variables`."""
    return {"steps": args.record_steps, "ranks": args.ranks, "phases": args.phases, "include": args.include,
            "exclude": args.exclude, "max_tensor_bytes": args.max_tensor_bytes}
