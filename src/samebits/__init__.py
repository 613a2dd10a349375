"""samebits: make PyTorch pretraining bitwise deterministic, and prove it.

    digest(t) / digest_many(ts)      64-bit fingerprints of tensors (docs/digest.md)
    global_digests(named, group=)    digests of full tensors from their shards (DTensor, FSDP2, TP)
    Recorder(dir, ...)               per-rank fingerprint streams (docs/stream.md)
    diff(run_a, run_b)               the comparator: identical, or the first divergence
    deterministic_mode(seed=...)     one switch: set, validate (fail closed) and record
    check(config) / probe(fn, ...)   rule violations / ops that really vary on this machine
    GradientAccumulator(params, ...) gradients with the same bits at any DP size (docs/invariance.md)

The public API is what ``__all__`` lists; every other module is private.
"""

from samebits.compare import DiffResult, diff
from samebits.determinism import check, deterministic_mode, probe
from samebits.errors import ConfigError, DeterminismError, IncomparableRunsError, SamebitsError, StreamError
from samebits.fingerprint import digest, digest_many, global_digests
from samebits.invariant import GradientAccumulator
from samebits.replicas import ReplicaCheck, check_replicas
from samebits.stream import Recorder, open_run
from samebits.verdicts import Verdict

# Registers the fused CUDA digest kernel with the fingerprint package (Triton imported on first use).
import samebits.kernels  # noqa: E402,F401  isort: skip

__version__ = "0.1.0"

__all__ = [
    "digest",
    "digest_many",
    "global_digests",
    "Recorder",
    "open_run",
    "diff",
    "DiffResult",
    "check_replicas",
    "ReplicaCheck",
    "Verdict",
    "GradientAccumulator",
    "deterministic_mode",
    "check",
    "probe",
    "SamebitsError",
    "ConfigError",
    "StreamError",
    "IncomparableRunsError",
    "DeterminismError",
]
