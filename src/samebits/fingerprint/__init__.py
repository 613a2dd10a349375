"""64-bit digests of tensors: equal digests mean bitwise-equal dtype, shape and contents.

Public: `digest(t)`, `digest_many(ts)` (one native call on CPU, one device-to-host copy per
accelerator) and `global_digests(named, group=None)` (the digest of each full tensor behind
DTensor, FSDP2 or Megatron shards, with no gather).  The spec, the split into a device part
(`body_sums`, no synchronisation) and a host part (`header`, `finalize`), and the internal but
stable names below are docs/digest.md ("API"): other samebits packages use those names, never
the ``_private`` modules.  `_reference.body_sum` is the torch-ops oracle every backend matches.
"""

from samebits._lazy_exports import lazy_exports

# Internal but stable, not in __all__: the digest's version and the dtype codes and sizes, plain
# data that the stream reader uses without torch.
from samebits.fingerprint._codes import DIGEST_VERSION, DTYPE_CODE_BY_NAME, ITEMSIZE_BY_NAME  # noqa: F401

# Every other name is imported from its module on first use (PEP 562), so that a reader of
# streams, which needs only the codes above, loads no torch (`samebits show`, `dump`).
_LAZY = {
    "digest": "_digest", "digest_many": "_digest", "global_digests": "_global",
    # Internal but stable: the Recorder records global digests through these.
    "GlobalSums": "_global", "global_body_sums": "_global",
    # Internal but stable, not in __all__: the Recorder and the tracer build on them.
    "body_sums": "_digest", "DTYPE_CODES": "_spec", "finalize": "_spec", "finalize_packed": "_spec", "header": "_spec",
    # Internal but stable, not in __all__: the stream encoder's fast paths (each documented where defined).
    "body_sums_of_checked": "_digest", "register_body_sum_backend": "_digest", "all_unsharded": "_global",
    "local_part": "_global", "StepFinalizer": "_native", "StepFramer": "_native", "body_sums_into": "_native",
    "native_available": ("_native", "available"), "dtype_code": "_spec",
    # The torch-ops oracle of the body sum (`_reference.body_sum`), which every backend must match.
    "reference_body_sum": ("_reference", "body_sum"),
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["digest", "digest_many", "global_digests"]
