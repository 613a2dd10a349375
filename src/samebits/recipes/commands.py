"""The reference recipe's command line, for the runners that launch it: the one place that
spells ``python -m samebits.recipes`` and its flags (`recipe_command`, `recipe_roles`), with
placeholders (``{out}``, ``{step}``, ``{ckpt}``, ``{reference}``) for `samebits.runners.commands`
to fill, and what `samebits matrix` needs of the recipe (precisions, cells, global metrics,
layout-invariant settings, `cell_overrides`).  No torch is loaded.
"""

from __future__ import annotations

import math
import sys
from typing import Sequence

from samebits.errors import ConfigError
from samebits.recipes import cells
from samebits.recipes.cells import ParallelDims

MODULE = "samebits.recipes"
NONDETERMINISTIC_PRESET = "nondeterministic"

# The recipe's precisions (`samebits.recipes.precision.PrecisionName`, which loads torch;
# tests/test_cli_inputs.py keeps the two lists equal).
PRECISIONS = ("fp32", "bf16", "bf16_params", "fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4")
DEFAULT_CELLS = ("single", "dp2", "ep2")
DEFAULT_PRECISIONS = ("fp32", "bf16", "fp8_delayed")
DEFAULT_GLOBAL_BATCH = 8
AGREEMENT_METRICS = ("grad_norm", "lr")  # the recipe's metrics that are global (equal on every rank)
# Per-replica randomness and per-rank losses make layouts differ by more than rounding:
# dropout and router jitter draw per data-parallel replica, and the load-balancing loss is
# each rank's own.  Off, two layouts compute the same function of the same global batch.
LAYOUT_INDEPENDENT = ("dropout=0", "moe_jitter_eps=0", "moe_aux_loss_coeff=0")
# `verify --across`: gradients reduced so that the bits do not depend on the DP size, experts
# replicated (EP over the DP ranks would couple them).
ACROSS_OVERRIDES = ("grad_reduce=invariant", "ep=1")


def launcher(nproc: int) -> list[str]:
    """How to start the recipe on ``nproc`` ranks: one process, or torchrun."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc} must be at least 1.")
    if nproc == 1:
        return [sys.executable, "-m", MODULE]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "-m", MODULE]


def recipe_command(nproc: int = 1, *, steps: int | str | None = None, preset: str | None = None,
                   overrides: Sequence[str] = (), out: str | None = None, reference: str | None = None,
                   save_at: int | str | None = None, ckpt: str | None = None, keep_going: bool = False,
                   resume_from: str | None = None, allow_layout_change: bool = False,
                   check: bool = False) -> list[str]:
    """The recipe's argv (its flags in one order); a value may be a placeholder such as
    ``"{out}"``, left for the runner.  See `python -m samebits.recipes --help`."""
    argv = launcher(nproc)
    for flag, value in (("--steps", steps), ("--preset", preset), *(("--set", item) for item in overrides),
                        ("--out", out), ("--reference", reference), ("--save-at", save_at), ("--ckpt", ckpt),
                        ("--keep-going", keep_going), ("--resume-from", resume_from),
                        ("--allow-layout-change", allow_layout_change), ("--check", check)):
        if value is True:  # a switch
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def recipe_roles(nproc: int, *, steps: int, overrides: Sequence[str] = (),
                 nondeterministic: bool = False) -> dict:
    """Every template a runner needs for the recipe on ``nproc`` ranks (the keyword arguments
    of `samebits.runners.program.SelfRecording`)."""
    base = {"steps": steps, "overrides": list(overrides),
            "preset": NONDETERMINISTIC_PRESET if nondeterministic else None}
    words = ["samebits", "bisect", "--steps", str(steps), "--nproc", str(nproc)]
    words += [part for item in overrides for part in ("--set", item)]
    return {
        "steps": steps,
        "nproc": nproc,
        "record": tuple(recipe_command(nproc, **base, out="{out}")),
        "save": tuple(recipe_command(nproc, **base, out="{out}", save_at="{step}", ckpt="{ckpt}", keep_going=True)),
        "save_only": tuple(recipe_command(nproc, **base, save_at="{step}", ckpt="{ckpt}")),
        "resume": tuple(recipe_command(nproc, **base, out="{out}", resume_from="{ckpt}")),
        "live_check": ("--reference", "{reference}"),
        "check": tuple(recipe_command(1, **base, check=True)),
        "bisect_words": tuple(words + (["--nondeterministic"] if nondeterministic else [])),
    }


def across_overrides(overrides: Sequence[str] = ()) -> list[str]:
    """The recipe's config for `verify --across`: ``ACROSS_OVERRIDES``, then the user's."""
    return [*ACROSS_OVERRIDES, *overrides]


def invariant_overrides(dims: ParallelDims) -> list[str]:
    """The switches that make cell ``dims``'s reductions independent of its layout, in `cells.AXES`
    order; a split axis with a refusal, or with neither, is a ConfigError naming it."""
    switches = []
    for axis in cells.AXES:
        if dims.size(axis) == 1:
            continue
        if axis.switch is None:
            why = axis.refusal or (f"the axis {axis.word} has neither a layout-invariant switch nor a refusal in "
                                   "samebits.recipes.cells.AXES; give it one before comparing layouts that split it")
            raise ConfigError(f"{dims.name}: {why} (docs/invariance.md); compare layouts without {axis.word}N, e.g. "
                              "single,dp2,tp2")
        switches.append(axis.switch)
    return list(dict.fromkeys(switches))


def across_switches(cells: Sequence[ParallelDims]) -> list[str]:
    """The switches every layout of a `verify --across` run gets: those any of ``cells`` needs
    (the layouts must compute the same function)."""
    return list(dict.fromkeys(s for dims in cells for s in invariant_overrides(dims)))


def invariant_reductions(switches: Sequence[str], layouts: Sequence[ParallelDims] | None = None) -> list[dict]:
    """What ``switches`` make invariant, one entry per axis of `cells.AXES` whose switch is among
    them; with ``layouts``, only the axes some layout splits (what a certificate exercised)."""
    return [{"switch": axis.switch, "size": axis.field, "covers": axis.covers} for axis in cells.AXES
            if axis.switch in switches and (layouts is None or any(dims.size(axis) > 1 for dims in layouts))]


def control_global_batch(cells: Sequence[ParallelDims]) -> int:
    """The global batch of `verify --across`'s controls: ``DEFAULT_GLOBAL_BATCH``, or the least
    multiple of it that every cell's data-parallel size divides."""
    return math.lcm(DEFAULT_GLOBAL_BATCH, *(dims.dp for dims in cells))


def across_cell_overrides(dims: ParallelDims, switches: Sequence[str], overrides: Sequence[str] = (), *,
                          control: bool = False, global_batch: int = DEFAULT_GLOBAL_BATCH) -> list[str]:
    """The recipe's ``--set`` overrides for one layout of `verify --across`: the cell's sizes,
    the run's ``switches``, then the user's ``overrides``.  ``control``: the negative control,
    switches off, with every control's global batch and `LAYOUT_INDEPENDENT`, so two controls
    differ only in the grouping of their reductions."""
    if not control:
        return [*dims.overrides(), *switches, *overrides]
    off = [f"{switch.partition('=')[0]}={'mean' if switch.startswith('grad_reduce') else 'plain'}"
           for switch in switches]
    sets_batch = any(item.partition("=")[0].strip() == "micro_batch_size" for item in overrides)
    return [*cell_overrides(dims, "fp32", global_batch=None if sets_batch else global_batch,
                            overrides=()), *off, *overrides]


def recorded_config_overrides(config: dict) -> list[str]:
    """A recorded run's config as ``--set KEY=VALUE`` words; values that are not scalars are
    annotations of the record (the resolved mesh), not settings."""
    return [word for key, value in sorted(config.items()) if value is None or isinstance(value, (str, int, float))
            for word in ("--set", f"{key}={'none' if value is None else value}")]


def check_precisions(precisions: Sequence[str]) -> None:
    """Refuse a precision the recipe does not have, naming those it has."""
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise ConfigError(f"--precisions: {', '.join(map(repr, unknown))} is not a precision; give a comma-separated "
                          f"list of {', '.join(PRECISIONS)}")


def check_matrix_overrides(overrides: Sequence[str], global_batch: int | None) -> None:
    """The matrix sets each cell's micro-batch from the global batch; a ``--set`` of it would
    win silently, and the cells would train on different global batches."""
    sets_batch = [item for item in overrides if item.partition("=")[0].strip() == "micro_batch_size"]
    if global_batch is not None and sets_batch:
        raise ConfigError(f"--set {sets_batch[0]} conflicts with --global-batch {global_batch}: the matrix sets "
                          f"each cell's micro_batch_size to {global_batch} / its data-parallel size, so that every "
                          "cell trains on the same global batch; drop the --set, or pass --global-batch 0 to keep "
                          "the recipe's micro-batch per rank")


def cell_overrides(dims: ParallelDims, precision: str, *, global_batch: int | None = DEFAULT_GLOBAL_BATCH,
                   layout_independent: bool = True, overrides: Sequence[str] = ()) -> list[str]:
    """The recipe's ``--set`` overrides for one matrix cell: its layout, its share of the
    global batch (micro-batch = global_batch / its data-parallel size; None: the recipe's),
    its precision, ``LAYOUT_INDEPENDENT`` (with ``layout_independent``), then ``overrides``.
    A global batch that does not split over the cell's data-parallel ranks is a ConfigError."""
    if global_batch is not None and global_batch % dims.dp:
        raise ConfigError(f"the global batch of {global_batch} does not split over {dims.dp} data-parallel ranks "
                          "(choose --global-batch)")
    batch = [] if global_batch is None else [f"micro_batch_size={global_batch // dims.dp}"]
    return [*dims.overrides(), *batch, f"precision={precision}",
            *(LAYOUT_INDEPENDENT if layout_independent else ()), *overrides]


__all__ = ["recipe_command", "recipe_roles", "launcher", "across_overrides", "recorded_config_overrides",
           "cell_overrides", "check_precisions", "check_matrix_overrides", "PRECISIONS", "DEFAULT_CELLS",
           "DEFAULT_PRECISIONS", "DEFAULT_GLOBAL_BATCH", "AGREEMENT_METRICS", "LAYOUT_INDEPENDENT", "ACROSS_OVERRIDES",
           "MODULE", "invariant_overrides", "across_switches",
           "invariant_reductions", "across_cell_overrides", "control_global_batch"]
