"""The reference recipe as the runners' program: the one library module that imports the recipe
(tests/test_architecture.py), composing its command line (`samebits.recipes.commands`) with
the runners of `samebits.runners`, which know no program.

    program = recipe_program(2, steps=8, overrides=["seed=3"])   # a runs.program.SelfRecording
    verify(program, out)                                          # samebits.runners.verify
"""

from __future__ import annotations

from typing import Mapping, Sequence

from samebits.cli._lazy import lazy
from samebits.recipes import commands as recipe
from samebits.recipes.cells import ParallelDims, parse_layouts

SelfRecording = lazy("samebits.runners.program", "SelfRecording")
Layout, CONTROL_STEPS = lazy("samebits.runners.across", "Layout", "CONTROL_STEPS")
MatrixProgram = lazy("samebits.runners.matrix", "MatrixProgram")


def recipe_program(nproc: int, *, steps: int, overrides: Sequence[str] = (), nondeterministic: bool = False,
                   recording: Mapping[str, object] | None = None):
    """The recipe run for ``steps`` steps on ``nproc`` ranks, as a `SelfRecording` program;
    ``recording``: `samebits.autorecord.recording_variables`' arguments."""
    return SelfRecording(**recipe.recipe_roles(nproc, steps=steps, overrides=overrides,
                                               nondeterministic=nondeterministic), recording=dict(recording or {}))


def tax_programs(nproc: int, *, steps: int, overrides: Sequence[str] = ()) -> dict:
    """`samebits tax` on the recipe: the deterministic run and the baseline, apart only in
    the recipe's ``deterministic`` switch."""
    return {label: recipe_program(nproc, steps=steps, overrides=[*overrides, f"deterministic={switch}"])
            for label, switch in (("deterministic", "true"), ("baseline", "false"))}


def across_size_layouts(sizes: Sequence[int], *, steps: int, overrides: Sequence[str] = ()) -> list:
    """`verify --across` on the recipe at data-parallel ``sizes``, in invariant mode: one
    `Layout` per size, with no control."""
    return [Layout(f"dp{size}", size, recipe_program(size, steps=steps, overrides=recipe.across_overrides(overrides)))
            for size in sizes]


def across_layouts(spec: str, *, steps: int, overrides: Sequence[str] = (), controls: bool = True) -> list:
    """`verify --across` on the recipe: the layouts ``spec`` names, each with the switches any of
    them needs (so they compute one function), and with ``controls`` its negative control (no
    switches, one global batch); its ``resume`` continues a checkpoint saved at another layout
    and saves its final step into ``{out}/ckpt`` for the certificate."""
    cells = parse_layouts(spec)
    switches = recipe.across_switches(cells)
    batch = recipe.control_global_batch(cells)
    layouts = []
    for dims in cells:
        sets = recipe.across_cell_overrides(dims, switches, overrides)
        control_sets = recipe.across_cell_overrides(dims, switches, overrides, control=True, global_batch=batch)
        control = recipe_program(dims.world_size, steps=min(steps, CONTROL_STEPS.resolve()), overrides=control_sets) \
            if controls else None
        resume = recipe.recipe_command(dims.world_size, steps=steps, overrides=sets, out="{out}", save_at=steps,
                                       ckpt="{out}/ckpt", keep_going=True, resume_from="{ckpt}",
                                       allow_layout_change=True)
        layouts.append(Layout(dims.name, dims.world_size, recipe_program(dims.world_size, steps=steps, overrides=sets),
                              control, tuple(sets), tuple(control_sets) if controls else (), tuple(resume)))
    return layouts


def across_reductions(spec: str) -> list[dict]:
    """What the switches of ``spec``'s layouts make invariant along the sizes they vary (the
    certificate's list)."""
    cells = parse_layouts(spec)
    return recipe.invariant_reductions(recipe.across_switches(cells), cells)


def replay_command(nproc: int) -> list[str]:
    """`samebits replay` on the recipe: resume ``{ckpt}`` on ``nproc`` ranks up to ``{stop}``,
    recording into ``{out}`` (the run's recorded config follows: `replay_config`)."""
    return recipe.recipe_command(nproc, steps="{stop}", resume_from="{ckpt}", out="{out}")


replay_config = recipe.recorded_config_overrides


def replay_config_at(nproc: int):
    """`samebits replay --nproc N` on the recipe: the recipe's words for a run's recorded config;
    at another rank count than the run's, N data-parallel ranks and ``--allow-layout-change``
    (the recipe refuses, naming the switch, where the run's bits depend on the layout)."""
    def words(config: dict) -> list[str]:
        said = replay_config(config)
        mesh = (config.get("parallel") or {}).get("mesh") if isinstance(config.get("parallel"), dict) else None
        if not isinstance(mesh, dict):
            return said
        recorded = ParallelDims(**{k: int(v) for k, v in mesh.items() if k in ParallelDims.__dataclass_fields__})
        if recorded.world_size == nproc:
            return said
        return [*said, *(word for item in ParallelDims(dp_replicate=nproc).overrides() for word in ("--set", item)),
                "--allow-layout-change"]

    return words


def matrix_program(*, overrides: Sequence[str] = (), nondeterministic: bool = False,
                   global_batch: int | None = recipe.DEFAULT_GLOBAL_BATCH, layout_independent: bool = True):
    """`samebits matrix` on the recipe: cells in its grammar, each cell's program with its layout,
    the global batch, the precision, the layout-independent settings and ``overrides``."""
    recipe.check_matrix_overrides(overrides, global_batch)

    def program(cell: ParallelDims, precision: str, steps: int):
        return recipe_program(cell.world_size, steps=steps, nondeterministic=nondeterministic,
                              overrides=recipe.cell_overrides(cell, precision, global_batch=global_batch,
                                                              layout_independent=layout_independent,
                                                              overrides=overrides))

    notes = []
    if global_batch is not None:
        notes.append(f"every cell trains on the same global batch of {global_batch} samples per step")
    notes.append("layout-independent settings for every cell: " + " ".join(recipe.LAYOUT_INDEPENDENT)
                 if layout_independent else "per-replica randomness kept: layouts are not expected to agree")
    return MatrixProgram(parse_cell=ParallelDims.parse, program=program, metrics=recipe.AGREEMENT_METRICS,
                         notes=tuple(notes))


__all__ = ["recipe_program", "tax_programs", "across_size_layouts", "across_layouts", "across_reductions", "replay_command",
           "replay_config", "replay_config_at", "matrix_program"]
