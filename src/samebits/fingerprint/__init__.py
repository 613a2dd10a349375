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

from samebits.fingerprint._digest import digest, digest_many
from samebits.fingerprint._global import global_digests

# Internal but stable: the Recorder records global digests through these.
from samebits.fingerprint._global import GlobalSums, GlobalTensor, global_body_sums, global_tensors  # noqa: F401

# Internal but stable, not in __all__: the Recorder and the tracer build on them.
from samebits.fingerprint._digest import body_sums  # noqa: F401
from samebits.fingerprint._spec import DIGEST_VERSION, DTYPE_CODES, finalize, finalize_packed, header  # noqa: F401

# Internal but stable, not in __all__: the stream encoder's fast paths (samebits.stream._encoder).
# `body_sums_of_checked(ts, device)`: `body_sums` of tensors already checked, all on ``device``;
# `dtype_code(dtype)`: the stream's one-byte dtype code; `all_unsharded(ts)`, `local_part(t)`: whether
# no tensor is sharded, and a tensor's local part; `native_available()`: whether the compiled
# library is loaded, and with it `body_sums_into` (sums of buffers by address), `StepFinalizer`
# (a step's digests into its encoded body) and `StepFramer` (a STEP frame: root, varints, crc).
from samebits.fingerprint._digest import body_sums_of_checked, register_body_sum_backend  # noqa: F401
from samebits.fingerprint._global import all_unsharded, local_part  # noqa: F401
from samebits.fingerprint._native import StepFinalizer, StepFramer, body_sums_into  # noqa: F401
from samebits.fingerprint._native import available as native_available  # noqa: F401
from samebits.fingerprint._spec import dtype_code  # noqa: F401
# The torch-ops oracle of the body sum (`_reference.body_sum`), which every backend must match.
from samebits.fingerprint._reference import body_sum as reference_body_sum  # noqa: F401

__all__ = ["digest", "digest_many", "global_digests"]
