"""Gradients with the same bits at any data-parallel size (docs/invariance.md).

    GradientAccumulator(named_params, num_micro_batches=M)   hand-written loops
    InvariantHookState + invariant_comm_hook                  DDP (register_comm_hook)
    InvariantReduceScatter                                    FSDP2 (set_custom_reduce_scatter)
    Preconditions(...).check()                                refuse what breaks invariance
    micro_batch_seed(seed, step, m)                           RNG keyed by (step, micro-batch)
    canonical_grad_norm / clip_grad_norm_                     the clipping norm in a fixed order
    invariant_matmul(a, b, group=...)                         a product whose K split over ranks keeps its bits
    column_parallel_linear / row_parallel_linear              TP linears built on it (exact forward, backward)
    invariant_sum / scale_columns                             sums over rows split over ranks (SP norm weights)
    sharded_grad_norm / clip_sharded_grad_norm_               the clipping norm of TP shards, same at any split

Each micro-batch's gradient is encoded in int64 fixed point per canonical block (exponent
from an exact MAX all-reduce), summed locally and across ranks in int64 (associative: any
order, tree or ring gives the same bits), and converted back to fp32 once, correctly rounded.
The tensor-parallel layers cut the reduction dimension into canonical blocks of 32, compute
each block's product exactly (block fixed point in fp64) and add the blocks in int64 the same
way, so tp=1, 2, 4 ... give the same bits.
"""

from samebits.invariant._fixed import DEFAULT_BLOCK_SIZE, block_exponents, decode, encode, fraction_bits
# Internal but stable, not in __all__: which CPU path the reduction runs (for benchmarks).
from samebits.invariant._fixed_native import describe as native_description  # noqa: F401
from samebits.invariant._matmul import (TP_BLOCK_SIZE, column_parallel_linear, invariant_matmul, invariant_sum,
                                       row_parallel_linear, scale_columns)
from samebits.invariant._norm import clip_sharded_grad_norm_, sharded_grad_norm
from samebits.invariant._preconditions import (LOSS_NORMALIZATIONS, RNG_KEYS, Preconditions, check_micro_batch_size,
                                               micro_batch_seed)
from samebits.invariant._reduce import (GradientAccumulator, InvariantHookState, InvariantReduceScatter, ReduceStats,
                                        canonical_grad_norm, clip_grad_norm_, invariant_comm_hook, reduce_blocks,
                                        ring_bytes)

__all__ = [
    "GradientAccumulator",
    "InvariantHookState",
    "invariant_comm_hook",
    "InvariantReduceScatter",
    "ReduceStats",
    "reduce_blocks",
    "Preconditions",
    "check_micro_batch_size",
    "micro_batch_seed",
    "canonical_grad_norm",
    "clip_grad_norm_",
    "fraction_bits",
    "block_exponents",
    "encode",
    "decode",
    "ring_bytes",
    "invariant_matmul",
    "column_parallel_linear",
    "row_parallel_linear",
    "invariant_sum",
    "scale_columns",
    "sharded_grad_norm",
    "clip_sharded_grad_norm_",
    "TP_BLOCK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "RNG_KEYS",
    "LOSS_NORMALIZATIONS",
]
