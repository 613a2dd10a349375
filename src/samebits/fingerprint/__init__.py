"""64-bit digests of tensors: equal digests mean bitwise-equal dtype, shape and contents.

The spec (byte order, constants, dtype codes, test vectors) is docs/digest.md.  Public API:

    digest(t) -> int                   # unsigned 64-bit digest of one tensor
    digest_many(ts) -> list[int]       # same for many: one native call on CPU, one
                                       # device-to-host copy per accelerator
    global_digests(named, group=None)  # {name: digest(full tensor)} of sharded tensors
                                       # (DTensor, FSDP2, Megatron TP), with no gather

A digest is computed in two parts, which callers that must not synchronise per tensor (the
Recorder, the tracer) use separately:

  device part, needs the data:  body_sums(ts) -> int64 tensor [n] on the tensors' device.
      The body sum S of each tensor (spec step 3).  On a GPU this only queues kernels: call it
      as soon as the tensors are ready, keep the returned tensor.  On CPU it computes at once.
      Tensors in one call must share a device.
  host part, needs metadata only:  header(dtype, shape) -> int   (spec step 4, cached)
                                   finalize(sums, headers) -> list[int]   (spec step 5)
      `finalize` reads the sums on the host; for a device tensor that is the one
      synchronisation, so call it at step end, for all tensors of the step at once.

    sums = body_sums(tensors)                              # launch now, no sync
    headers = [header(t.dtype, t.shape) for t in tensors]  # metadata only
    ...                                                    # rest of the step
    digests = finalize(sums, headers)                      # one sync, at step end

`DIGEST_VERSION` (the version of the digest's definition that every persisted digest records),
`body_sums`, `header`, `finalize` (and `finalize_packed`, the same for a numpy array of sums,
as packed little-endian bytes), `DTYPE_CODES`, the stream encoder's fast paths listed below and
`register_body_sum_backend` (how `samebits.kernels` adds its CUDA body sum) with
`reference_body_sum` (the oracle its kernel matches) are internal but
stable: other samebits packages use these names, never the `_private` modules.  `_reference.body_sum(data_uint8_1d)` is the torch-ops oracle that
every backend (the C library here, the CUDA kernel in samebits.kernels) must match bit for bit.
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
    "GlobalSums": "_global", "GlobalTensor": "_global", "global_body_sums": "_global", "global_tensors": "_global",
    # Internal but stable, not in __all__: the Recorder and the tracer build on them.
    "body_sums": "_digest", "DTYPE_CODES": "_spec", "finalize": "_spec", "finalize_packed": "_spec", "header": "_spec",
    # Internal but stable, not in __all__: the stream encoder's fast paths (samebits.stream._encoder).
    # `body_sums_of_checked(ts, device)`: `body_sums` of tensors already checked, all on ``device``;
    # `dtype_code(dtype)`: the stream's one-byte dtype code; `all_unsharded(ts)`, `local_part(t)`: whether
    # no tensor is sharded, and a tensor's local part; `native_available()`: whether the compiled
    # library is loaded, and with it `body_sums_into` (sums of buffers by address), `StepFinalizer`
    # (a step's digests into its encoded body) and `StepFramer` (a STEP frame: root, varints, crc).
    "body_sums_of_checked": "_digest", "register_body_sum_backend": "_digest", "all_unsharded": "_global",
    "local_part": "_global", "StepFinalizer": "_native", "StepFramer": "_native", "body_sums_into": "_native",
    "native_available": ("_native", "available"), "dtype_code": "_spec",
    # The torch-ops oracle of the body sum (`_reference.body_sum`), which every backend must match.
    "reference_body_sum": ("_reference", "body_sum"),
}


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())


__all__ = ["digest", "digest_many", "global_digests"]
