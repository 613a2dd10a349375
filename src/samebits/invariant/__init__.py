"""Gradients with the same bits at any data-parallel size (docs/invariance.md).

    GradientAccumulator(named_params, num_micro_batches=M)   hand-written loops
    InvariantHookState + invariant_comm_hook                  DDP (register_comm_hook)
    InvariantReduceScatter                                    FSDP2 (set_custom_reduce_scatter)
    Preconditions(...).check()                                refuse what breaks invariance
    micro_batch_seed(seed, step, m)                           RNG keyed by (step, micro-batch)
    manual_seed(seed)                                         torch.manual_seed's effect, cheap on a CPU-only host
    canonical_grad_norm / clip_grad_norm_                     the clipping norm in a fixed order
    tree_matmul(a, b, group=...)                              platform GEMM leaves added in one fixed tree: a
                                                              product whose K split over ranks keeps its bits
    gemm_matmul(a, b)                                         one GEMM whose bits depend on its row and column only
    invariant_matmul(a, b, group=...)                         the same with exact block products (mode="exact")
    column_parallel_linear / row_parallel_linear              TP linears built on them (forward, backward)
    gather_columns(x, group=...)                              a column layer's blocks joined (the loss whole)
    invariant_sum / scale_columns                             sums over rows split over ranks (SP norm weights)
    sharded_grad_norm / clip_sharded_grad_norm_               the clipping norm of TP shards, same at any split

Each micro-batch's gradient is encoded in int64 fixed point per canonical block (exponent
from an exact MAX all-reduce), summed locally and across ranks in int64 (associative: any
order, tree or ring gives the same bits), and converted back to fp32 once, correctly rounded.
The tensor-parallel layers cut the reduction dimension into canonical leaves, compute each
with the platform's fp32 GEMM (on shapes measured to give bits that depend on the leaf only,
benchmarks/gemm_block_bits.py) and add them in one fixed binary tree, so tp=1, 2, 4, 8 give
the same bits; ``mode="exact"`` keeps exact fp64 block products added in int64.
"""

from samebits.invariant._fixed import DEFAULT_BLOCK_SIZE, block_exponents, decode, encode, fraction_bits
# Internal but stable, not in __all__: which CPU path the reduction runs (for benchmarks).
from samebits.invariant._fixed_native import describe as native_description  # noqa: F401
from samebits.invariant._matmul import (MAX_LEAVES, TP_BLOCK_SIZE, TP_MATMUL_MODES, column_parallel_linear,
                                       gather_columns, gemm_matmul, invariant_matmul, invariant_sum, row_parallel_linear,
                                       scale_columns, tree_matmul)
from samebits.invariant._norm import clip_sharded_grad_norm_, sharded_grad_norm
from samebits.invariant._preconditions import (LOSS_NORMALIZATIONS, RNG_KEYS, Preconditions, check_micro_batch_size,
                                               manual_seed, micro_batch_seed)
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
    "manual_seed",
    "canonical_grad_norm",
    "clip_grad_norm_",
    "fraction_bits",
    "block_exponents",
    "encode",
    "decode",
    "ring_bytes",
    "invariant_matmul",
    "gemm_matmul",
    "tree_matmul",
    "TP_MATMUL_MODES",
    "MAX_LEAVES",
    "column_parallel_linear",
    "row_parallel_linear",
    "gather_columns",
    "invariant_sum",
    "scale_columns",
    "sharded_grad_norm",
    "clip_sharded_grad_norm_",
    "TP_BLOCK_SIZE",
    "DEFAULT_BLOCK_SIZE",
    "RNG_KEYS",
    "LOSS_NORMALIZATIONS",
]
