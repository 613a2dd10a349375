"""Command line of the reference recipe (`python -m samebits.recipes`): parse, call `train`,
print.  Options, examples and exit codes (0 done or saved, 2 could not run, 3 stopped at a
step that differs from ``--reference``) are in docs/recipe.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import samebits
from samebits import checkpoint
from samebits.autorecord import EXIT_STOPPED, STOPPED_MARKER  # --out marker when the live check stopped the run
from samebits.errors import ConfigError, SamebitsError
from samebits.recipes.config import PRESETS, RecipeConfig
from samebits.recipes.loop import session, train
from samebits.recipes.cells import AXES, ParallelDims, parse_cell
from samebits.verdicts import EXIT_CANNOT_RUN, EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m samebits.recipes",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="total optimizer steps (default 20)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="starting config; --set overrides apply on top")
    parser.add_argument("--cell", metavar="NAME",
                        help=f"parallel layout, e.g. {', '.join(f'{axis.word}2' for axis in AXES)}, tp2-dp2, fsdp2-tp2 "
                             f"(sets {', '.join(axis.field for axis in AXES[:-1])} and {AXES[-1].field}; --set applies "
                             "after)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override one config field (repeatable)")
    parser.add_argument("--out", type=Path, help="record fingerprint streams into this directory")
    parser.add_argument("--reference", type=Path,
                        help="compare each step live against the streams of this earlier run")
    parser.add_argument("--save-at", type=_save_steps, metavar="K",
                        help="save a checkpoint before step K into --ckpt, then exit; K,K,... saves before "
                             "each (with --keep-going)")
    parser.add_argument("--ckpt", type=Path, help="checkpoint root for --save-at")
    parser.add_argument("--keep-going", action="store_true",
                        help="after --save-at, train on to --steps instead of exiting")
    parser.add_argument("--resume-from", type=Path, metavar="DIR",
                        help="checkpoint root (its latest) or step-K directory to resume from")
    parser.add_argument("--allow-layout-change", action="store_true",
                        help="with --resume-from: the checkpoint may have been saved at another DP "
                             "size (needs grad_reduce=invariant) or TP size (tp_reduce=invariant); "
                             "the stream header records the saved layout (docs/checkpoint.md)")
    parser.add_argument("--check", action="store_true",
                        help="check the options and the config (preset, cell, --set), then exit: no training")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = PRESETS[args.preset]()
        if args.cell is not None:
            cfg = RecipeConfig.from_dict({**cfg.to_dict(), **parse_cell(args.cell)})
        cfg = cfg.with_overrides(args.overrides)
        if (args.save_at is None) != (args.ckpt is None):
            raise ConfigError("--save-at and --ckpt go together: give both or neither")
        if args.save_at is not None and len(args.save_at) > 1 and not args.keep_going:
            raise ConfigError(f"--save-at {','.join(map(str, args.save_at))}: saving at several steps needs "
                              "--keep-going (the run trains on after each save)")
        if args.keep_going and args.save_at is None:
            raise ConfigError("--keep-going needs --save-at K and --ckpt DIR (it trains on after saving)")
        if args.allow_layout_change and args.resume_from is None:
            raise ConfigError("--allow-layout-change needs --resume-from DIR (it lets that checkpoint "
                              "load under another layout)")
        if args.reference is not None and args.out is None:
            raise ConfigError("--reference needs --out (the live check runs in the recorder)")
    except ValueError as err:
        print(f"samebits.recipes: error: {err}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if args.check:
        print("samebits.recipes: the options and the config are valid")
        return EXIT_OK

    rank, recorder = 0, None
    try:
        with session(cfg) as (rank, world_size):
            if args.out is not None:
                recorder = _make_recorder(args, cfg, rank, world_size)
            try:
                result = train(cfg, steps=args.steps, recorder=recorder, save_at=args.save_at,
                               ckpt_dir=args.ckpt, resume_from=args.resume_from,
                               allow_layout_change=args.allow_layout_change, keep_going=args.keep_going,
                               log=True)
            finally:
                if recorder is not None and hasattr(recorder, "close"):
                    recorder.close()
    except (ValueError, SamebitsError) as err:
        print(f"samebits.recipes: error (rank {rank}): {err}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if rank == 0:
        if result.checkpoint is not None and not args.keep_going:
            print(f"saved {result.checkpoint} (before step {result.end_step}); exiting")
        if result.stopped_at is not None:
            print(f"stopped at step {result.stopped_at}: diverged from reference")
            if args.out is not None:  # launchers (torchrun) replace exit code 3 by their own
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / STOPPED_MARKER).write_text(
                    json.dumps({"stopped_at": result.stopped_at, "reason": "diverged from reference"}) + "\n")
    return EXIT_STOPPED if result.stopped_at is not None else EXIT_OK


def _save_steps(text: str) -> list[int]:
    """``--save-at K`` or ``K,K,...``: the steps to save before (non-negative, distinct)."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step or a comma-separated list of steps "
                                         "(e.g. 10 or 10,20)") from None
    if any(step < 0 for step in steps) or len(set(steps)) != len(steps):
        raise argparse.ArgumentTypeError(f"{text!r}: give distinct steps >= 0 (e.g. 10 or 10,20)")
    return sorted(steps)


def _make_recorder(args, cfg: RecipeConfig, rank: int, world_size: int):
    kwargs = {"reference": args.reference} if args.reference is not None else {}
    if args.resume_from is not None:
        kwargs["append"] = True  # a resumed run continues the stream of the run it resumes
    dims = ParallelDims.resolve(cfg, world_size)
    # The stream header records the cell and its mesh sizes next to the config.
    config = {**cfg.to_dict(), "parallel": {"cell": dims.name, "mesh": dims.sizes()}}
    if args.allow_layout_change:  # the run records the layout it resumed from (the header: this one)
        saved = checkpoint.saved_layout(args.resume_from)
        config["resumed_from"] = {k: saved[k] for k in ("step", "world_size", "layout")}
    return samebits.Recorder(args.out, rank=rank, world_size=world_size, config=config,
                             coords=dims.coordinates(rank), **kwargs)
