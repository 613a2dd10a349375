"""Compatibility: the Recorder's old module.  `samebits.stream.recorder` is the Recorder now
(its encoder is `_encoder`, its files `_files`); import `Recorder`, `GLOBAL_PHASE_PREFIX` and
`STEP_TIMES_SUFFIX` from `samebits.stream`."""

from samebits.stream.recorder import GLOBAL_PHASE_PREFIX, RUN_ID_FILE, STEP_TIMES_SUFFIX, Recorder, RecorderHook

__all__ = ["Recorder", "RecorderHook", "GLOBAL_PHASE_PREFIX", "STEP_TIMES_SUFFIX", "RUN_ID_FILE"]
