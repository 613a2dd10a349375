"""Public grouped GEMM with router-probability scaling, whose backward computes dprob in the
GEMM epilogue (the kernel under test), plus its autograd wiring."""

from __future__ import annotations

import torch

from samebits.kernels import _backend
from samebits.kernels._reference import reference_grouped_gemm_dprob
from samebits.errors import ConfigError

_NAME = "grouped_gemm_dprob"


class _GroupedLinearWithProb(torch.autograd.Function):
    """y = prob[:, None] * (x @ W_e) per expert.  Backward: dprob by the epilogue kernel
    (atomic or slot variant), dx = prob * (dy @ W_e^T), dW_e = x_e^T @ (prob_e * dy_e)."""

    @staticmethod
    def forward(ctx, x, weight, tokens_per_expert, prob, variant, tiles):
        from samebits.kernels import _triton_gemm as kernels

        schedule = kernels.make_schedule(tokens_per_expert, x.shape[0], tiles.block_m)
        y = kernels.grouped_gemm(x, weight, schedule, prob, tiles)  # (T, N)
        ctx.save_for_backward(x, weight, prob)
        ctx.schedule, ctx.variant, ctx.tiles = schedule, variant, tiles
        return y

    @staticmethod
    def backward(ctx, dy):
        from samebits.kernels import _triton_gemm as kernels

        x, weight, prob = ctx.saved_tensors
        dy = dy.contiguous()  # (T, N)
        dx = dw = dprob = None
        if ctx.needs_input_grad[3]:
            dprob = kernels.grouped_dprob(
                x, weight, ctx.schedule, dy, ctx.variant, ctx.tiles, prob.dtype
            )
        if ctx.needs_input_grad[0]:
            # W_e^T as a strided view: no copy of the weights.
            dx = kernels.grouped_gemm(dy, weight.transpose(1, 2), ctx.schedule, prob, ctx.tiles)
        if ctx.needs_input_grad[1]:
            dw = kernels.grouped_wgrad(x, dy, prob, ctx.schedule, weight.dtype, ctx.tiles)
        return dx, dw, None, dprob, None, None


def grouped_gemm_dprob(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    prob: torch.Tensor,
    *,
    variant: str = "deterministic",
    block_m: int = 128,
    block_n: int = 128,
    block_k: int = 64,
) -> torch.Tensor:
    """Grouped expert GEMM scaled by the router probability; differentiable in x, weight, prob.

    Args:
        x: (T, K) fp16/bf16/fp32 rows sorted by expert (expert 0's rows first).
        weight: (E, K, N) same dtype as x.
        tokens_per_expert: (E,) integer rows per expert; must sum to T (not checked on the
            Triton path, which never syncs the host; rows past the sum are never written).
        prob: (T,) router probability of each row (any float dtype; dprob has its dtype).
        variant: "deterministic" (dprob partials in private (row, N-tile) slots, summed in
            tile order), "atomic" (partials `atomic_add`-ed into dprob: run-to-run varying on
            a GPU) or "torch" (`reference_grouped_gemm_dprob`).  The forward is identical.
        block_m, block_n, block_k: tile sizes (powers of two >= 16).  Deterministic dprob
            bits are repeatable for fixed tiles; a different block_n or block_k changes the
            summation order, hence possibly the bits.

    Returns:
        (T, N) in x.dtype: y[t] = prob[t] * (x[t] @ weight[e(t)]).

    Falls back to the torch reference, with a warning, when Triton cannot run on x.device
    (see `samebits.kernels.available`).
    """
    _backend.check_variant(variant, _NAME)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        _backend.check_block(name, value, _NAME, minimum=16)
    if x.dim() != 2 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ConfigError(
            f"{_NAME}: expected x (T, K) and weight (E, K, N), got x {tuple(x.shape)} and "
            f"weight {tuple(weight.shape)}"
        )
    if tokens_per_expert.shape != (weight.shape[0],) or tokens_per_expert.is_floating_point():
        raise ConfigError(
            f"{_NAME}: tokens_per_expert must be an integer tensor of shape (E,) = "
            f"({weight.shape[0]},), got {tokens_per_expert.dtype} {tuple(tokens_per_expert.shape)}"
        )
    if prob.shape != (x.shape[0],):
        raise ConfigError(
            f"{_NAME}: prob must have shape (T,) = ({x.shape[0]},), got {tuple(prob.shape)}; "
            "pass the probability of each expert-sorted row"
        )
    if variant == "torch":
        return reference_grouped_gemm_dprob(x, weight, tokens_per_expert, prob)
    if not _backend.triton_runs_on(x.device):
        _backend.warn_fallback(_NAME, variant, x.device)
        return reference_grouped_gemm_dprob(x, weight, tokens_per_expert, prob)
    if x.dtype not in _backend.TRITON_DTYPES or weight.dtype != x.dtype:
        raise ConfigError(
            f"{_NAME}: the Triton kernels take x and weight of one dtype among fp16, bf16, "
            f"fp32; got x {x.dtype} and weight {weight.dtype}; cast them or pass variant='torch'"
        )
    from samebits.kernels._triton_gemm import Tiles

    tiles = Tiles(block_m, block_n, block_k)
    return _GroupedLinearWithProb.apply(
        x.contiguous(), weight.contiguous(), tokens_per_expert.to(x.device), prob.contiguous(),
        variant, tiles,
    )
