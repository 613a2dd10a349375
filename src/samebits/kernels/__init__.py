"""Deterministic GPU kernels, with their arrival-order (atomic) twins for comparison.

Three kernels, each in two variants that use the same tiles and parallelism and differ only
in how partial results are combined: `atomic` adds them into one address in arrival order
(varies run to run on a GPU); `deterministic` gives every tile a private slot and combines
the slots in a fixed order.

- `grouped_gemm_dprob`: grouped expert GEMM scaled by the router probability; its backward
  computes dprob[t] = sum_n dY[t, n] * Y[t, n] in the GEMM epilogue.
- `moe_combine`: the MoE unpermute out[t] = sum_k prob[t, k] * expert_out[slot[t, k]].
- `digest_body`: the body of the samebits tensor digest, one fused pass over the bytes.

And the block fixed point of samebits.invariant's reduction on the GPU (`fixed_point_encode_sum`,
`fixed_point_decode`, elementwise: one variant, bit for bit the torch definition).

Triton is optional.  `available()` says whether the kernels run here (CUDA, or the CPU
interpreter with TRITON_INTERPRET=1); otherwise every function falls back to its torch
reference (`reference_*`), with a warning for the kernel variants.  See docs/kernels.md.
"""

from samebits.kernels._backend import available
from samebits.kernels._combine import moe_combine
from samebits.kernels._digest import digest_body, digest_body_many
from samebits.kernels._fixed import fixed_point_decode, fixed_point_encode_sum, fixed_point_runs_on
from samebits.kernels._gemm import grouped_gemm_dprob
from samebits.kernels._reference import reference_grouped_gemm_dprob, reference_moe_combine
from samebits.fingerprint import register_body_sum_backend

# The digest of CUDA tensors runs this package's fused kernel (same bits as the reference).
register_body_sum_backend("cuda", digest_body)

__all__ = [
    "available",
    "grouped_gemm_dprob",
    "moe_combine",
    "digest_body",
    "digest_body_many",
    "fixed_point_encode_sum",
    "fixed_point_decode",
    "fixed_point_runs_on",
    "reference_grouped_gemm_dprob",
    "reference_moe_combine",
]
