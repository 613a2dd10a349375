"""Exact resume: save and load everything a bitwise-identical continuation needs.

    bundle = StateBundle(model=model, optimizer=opt, lr_scheduler=sched,
                         progress={"step": step, "consumed_samples": n},
                         generators={"dropout": gen}, layout={"dp": 2})
    save("ckpt", bundle)          # collective; commits ckpt/step-<step> atomically
    load("ckpt", bundle)          # collective; follows ckpt/latest, restores in place
    load("ckpt", bundle, allow_layout_change=True)  # another DP/TP size: replicated state,
                                  # shards cut by StateBundle.shards, refusals by name

Per rank it stores model, optimizer (by parameter name), LR schedule, loop position and
every random state (Python, NumPy, torch CPU, CUDA per device, the bundle's generators),
with `torch.distributed.checkpoint` writing each rank's shards.  See docs/checkpoint.md.

`content_sha256(path)` hashes the training state a checkpoint holds (model and optimizer
tensors as global values, the progress) and its whole resumable state (`STATE_PARTS`: every
progress field, optimizer settings, scheduler, metadata less its layout entries, rank 0's
random states), each the same for the same state saved at any layout.

`state_census(...)` lists the same states as named tensors, recorded at each step start in
the `STATE_PHASE` phase of the run's census stream (`census_recorder`, `CENSUS_DIR`), so a
resume that lost one shows which (`describe_state_record`); `CensusName` parses and formats
the records' names.
"""

from samebits.checkpoint._bundle import StateBundle, TensorShard
from samebits.checkpoint._content import STATE_PARTS, content_sha256
from samebits.checkpoint._census import (CENSUS_DIR, STATE_PHASE, census_recorder, census_run, global_rng_record,
                                         state_census)
from samebits.checkpoint._names import CensusName, describe_state_record, has_scheduler
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError
from samebits.checkpoint._rng import GLOBAL_RNG_NAMES, capture_rng_state, restore_rng_state
from samebits.checkpoint._storage import DROP_RNG_ENV, SAVE_PAUSE_ENV, load, resolve, save, saved_layout

__all__ = [
    "StateBundle",
    "TensorShard",
    "save",
    "load",
    "resolve",
    "saved_layout",
    "content_sha256",
    "STATE_PARTS",
    "capture_rng_state",
    "restore_rng_state",
    "CheckpointError",
    "CheckpointLayoutError",
    "GLOBAL_RNG_NAMES",
    "DROP_RNG_ENV",
    "SAVE_PAUSE_ENV",
    "state_census",
    "describe_state_record",
    "CensusName",
    "has_scheduler",
    "global_rng_record",
    "STATE_PHASE",
    "CENSUS_DIR",
    "census_recorder",
    "census_run",
]
