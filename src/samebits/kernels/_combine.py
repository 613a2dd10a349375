"""Public MoE combine (unpermute) with atomic and deterministic forward kernels."""

from __future__ import annotations

import torch

from samebits.kernels import _backend
from samebits.kernels._reference import reference_moe_combine
from samebits.errors import ConfigError

_NAME = "moe_combine"


class _MoECombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, prob, slot_index, variant, block_h):
        from samebits.kernels import _triton_combine as kernels

        ctx.save_for_backward(expert_out, prob, slot_index)
        ctx.block_h = block_h
        return kernels.combine(expert_out, prob, slot_index, variant, block_h)

    @staticmethod
    def backward(ctx, dout):
        from samebits.kernels import _triton_combine as kernels

        expert_out, prob, slot_index = ctx.saved_tensors
        d_eo, d_prob = kernels.combine_backward(
            expert_out, prob, slot_index, dout.contiguous(), ctx.block_h
        )
        return (
            d_eo if ctx.needs_input_grad[0] else None,
            d_prob if ctx.needs_input_grad[1] else None,
            None, None, None,
        )


def moe_combine(
    expert_out: torch.Tensor,
    prob: torch.Tensor,
    slot_index: torch.Tensor,
    *,
    variant: str = "deterministic",
    block_h: int = 1024,
) -> torch.Tensor:
    """MoE combine (unpermute): out[t] = sum_k prob[t, k] * expert_out[slot_index[t, k]].

    Args:
        expert_out: (R, H) fp16/bf16/fp32 expert outputs, one row per routed (token, k),
            usually sorted by expert; rows no token reads (padding) are allowed.
        prob: (T, K) router probabilities (any float dtype; its gradient has its dtype).
        slot_index: (T, K) integer rows of expert_out, in [0, R), pairwise distinct (each
            row belongs to one (token, k), as after an MoE permute; not checked).
        variant: "deterministic" (each token gathers its K rows and adds them in k order),
            "atomic" (each expert-output row atomically adds into out[token]: run-to-run
            varying on a GPU) or "torch" (`reference_moe_combine`).
        block_h: hidden-dim block (power of two).  The deterministic result does not depend
            on it; the backward's dprob sum (over H) does.

    Returns:
        (T, H) in expert_out.dtype, accumulated in fp32.  Differentiable in expert_out and
        prob; the backward is a gather with no cross-program reduction, shared by both
        variants.  Falls back to the torch reference, with a warning, when Triton cannot run
        on expert_out.device.
    """
    _backend.check_variant(variant, _NAME)
    _backend.check_block("block_h", block_h, _NAME, minimum=16)
    if expert_out.dim() != 2 or prob.dim() != 2 or slot_index.shape != prob.shape:
        raise ConfigError(
            f"{_NAME}: expected expert_out (R, H), prob (T, K) and slot_index (T, K), got "
            f"{tuple(expert_out.shape)}, {tuple(prob.shape)} and {tuple(slot_index.shape)}"
        )
    if slot_index.is_floating_point():
        raise ConfigError(f"{_NAME}: slot_index must be an integer tensor, got {slot_index.dtype}")
    if variant == "torch":
        return reference_moe_combine(expert_out, prob, slot_index)
    if not _backend.triton_runs_on(expert_out.device):
        _backend.warn_fallback(_NAME, variant, expert_out.device)
        return reference_moe_combine(expert_out, prob, slot_index)
    if expert_out.dtype not in _backend.TRITON_DTYPES:
        raise ConfigError(
            f"{_NAME}: the Triton kernels take expert_out in fp16, bf16 or fp32, got "
            f"{expert_out.dtype}; cast it or pass variant='torch'"
        )
    return _MoECombine.apply(
        expert_out.contiguous(), prob.contiguous(), slot_index.contiguous(), variant, block_h
    )
