"""Exact resume: save and load everything a bitwise-identical continuation needs.

    bundle = StateBundle(model=model, optimizer=opt, lr_scheduler=sched,
                         progress={"step": step, "consumed_samples": n},
                         generators={"dropout": gen}, layout={"dp": 2})
    save("ckpt", bundle)          # collective; commits ckpt/step-<step> atomically
    load("ckpt", bundle)          # collective; follows ckpt/latest, restores in place

Also `content_sha256` (the training state's hashes, the same at any layout) and the state
census (`state_census`, `census_recorder`, `CensusName`, `describe_state_record`).
See docs/checkpoint.md.
"""

from samebits.checkpoint._bundle import StateBundle, TensorShard
from samebits.checkpoint._content import STATE_PARTS, content_sha256
from samebits.checkpoint._census import (CENSUS_DIR, STATE_PHASE, census_recorder, census_run, global_rng_record,
                                         state_census)
from samebits.checkpoint._names import CensusName, describe_state_record, has_scheduler
from samebits.checkpoint._errors import CheckpointError, CheckpointLayoutError
from samebits.checkpoint._rng import GLOBAL_RNG_NAMES, capture_rng_state, restore_rng_state
from samebits.checkpoint._storage import DROP_RNG_ENV, SAVE_PAUSE_ENV, load, resolve, save, saved_layout

__all__ = ["StateBundle", "TensorShard", "save", "load", "resolve", "saved_layout", "content_sha256", "STATE_PARTS",
           "capture_rng_state", "restore_rng_state", "CheckpointError", "CheckpointLayoutError", "GLOBAL_RNG_NAMES",
           "DROP_RNG_ENV", "SAVE_PAUSE_ENV", "state_census", "describe_state_record", "CensusName", "has_scheduler",
           "global_rng_record", "STATE_PHASE", "CENSUS_DIR", "census_recorder", "census_run"]
