"""The gradient norm with the same bits however the gradients are sharded (tensor-parallel
shards, replicated tensors): the clipping norm of `tp_reduce=invariant` (docs/invariance.md).

Each tensor's sum of squares is exact up to one fixed quantum per tensor: its squares
(exact in fp64: a 24-bit significand squared is 48 bits) are encoded as int64 integers in
units of 2**(e - P), e the tensor's exponent (smallest with every square < 2**e: an exact
MAX all-reduce over the shards) and P = 62 - ceil(log2(full numel)), so the tensor's whole sum
fits int64 in any order.  The int64 sums of every rank's shard are added by an all-reduce
(replicated tensors counted once, from the group's first rank), decoded to fp64 (one
rounding), and the tensors' sums added sequentially in the given order.  Nothing depends on
where the shards begin or how many ranks hold them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from samebits._torchutil import group_rank_and_world_size
from samebits.errors import ConfigError
from samebits.invariant._fixed import pow2_clamped
from samebits.invariant._fixed_native import peaks, square_sums

_SUM_BITS = 62
_ZERO_EXP = -4096  # a tensor of zeros
_NONFINITE_EXP = 4096  # a tensor holding inf or nan on some rank: the norm is nan


def sharded_grad_norm(grads: Sequence[torch.Tensor], *, full_numels: Sequence[int] | None = None,
                      group=None, replicated: Sequence[bool] | None = None,
                      counted: Sequence[bool] | None = None) -> torch.Tensor:
    """The L2 norm (fp32, 0-dim, the same on every rank of ``group``) of tensors that are
    each either this rank's shard of a tensor of ``full_numels[i]`` elements split over
    ``group`` (``full_numels[i]`` > the local numel) or whole and the same on every rank of
    ``group`` (``full_numels[i]`` equal to it, or ``full_numels`` None).  The same bits
    however the tensors are split, at any group size (``group=None``: this rank alone).
    ``replicated[i]`` False says tensor i is split even where one rank holds it whole (a
    pipeline stage's tensor, empty on the other stages): every rank's part is summed.
    ``counted[i]`` False: this rank's part of tensor i is a copy another rank of ``group``
    counts (a TP copy of a norm weight, a replica's shard) and is left out of the sum."""
    grads = list(grads)
    full = [g.numel() for g in grads] if full_numels is None else [int(n) for n in full_numels]
    if len(full) != len(grads):
        raise ConfigError(f"sharded_grad_norm: {len(grads)} gradients but {len(full)} full_numels")
    whole = [n == g.numel() for g, n in zip(grads, full)] if replicated is None else [bool(r) for r in replicated]
    if len(whole) != len(grads):
        raise ConfigError(f"sharded_grad_norm: {len(grads)} gradients but {len(whole)} replicated flags")
    bad = [i for i, (g, n) in enumerate(zip(grads, full)) if n < g.numel()]
    if bad:
        raise ConfigError(f"sharded_grad_norm: gradient {bad[0]} holds {grads[bad[0]].numel()} elements, "
                          f"more than its full_numels entry {full[bad[0]]}; pass the full tensor's size")
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].device
    rank, world_size = (0, 1) if group is None else group_rank_and_world_size(group)
    split = [i for i, (g, n) in enumerate(zip(grads, full)) if n > g.numel()]
    if split and world_size == 1:
        raise ConfigError(f"sharded_grad_norm: gradient {split[0]} is a shard ({grads[split[0]].numel()} of "
                          f"{full[split[0]]} elements) but no group of ranks holds the rest; pass the "
                          "group it is split over")
    if counted is not None and len(counted) != len(grads):
        raise ConfigError(f"sharded_grad_norm: {len(grads)} gradients but {len(counted)} counted flags")
    flat = [g.detach().reshape(-1).to(device) for g in grads]
    if counted is not None:
        flat = [g if keep else g[:0] for g, keep in zip(flat, counted)]
    # Each tensor's largest square, (max |g|)**2: exact in fp64 (a 24-bit significand squared
    # is 48 bits), and nan/inf where the tensor holds one; one vector of exponents for all.
    peak = peaks(flat)  # the C library's one pass a tensor, or:
    if peak is None:
        zero = torch.zeros((), dtype=torch.float32, device=device)
        peak = torch.stack([g.abs().amax() if g.numel() else zero for g in flat])
    peak = peak.to(torch.float64).square()
    _, exps = torch.frexp(peak)  # peak < 2**exp
    exps = torch.where(peak > 0, exps.to(torch.int64), torch.full_like(exps, _ZERO_EXP, dtype=torch.int64))
    exps = torch.where(torch.isfinite(peak), exps, torch.full_like(exps, _NONFINITE_EXP))
    if world_size > 1:
        dist.all_reduce(exps, op=dist.ReduceOp.MAX, group=group)  # exact
    bits = torch.tensor([_SUM_BITS - (math.ceil(math.log2(n)) if n > 1 else 0) for n in full],
                        dtype=torch.int64, device=device)
    scales = pow2_clamped(bits - exps)  # exact powers of two
    counted = [g if not (whole[i] and rank != 0) else g[:0] for i, g in enumerate(flat)]  # replicated: from rank 0
    sums = square_sums(counted, scales)  # the C library's one pass a tensor: the same integers
    if sums is None:
        sums = torch.stack([_square_sum(g, scales[i]) for i, g in enumerate(counted)])
    if world_size > 1:
        dist.all_reduce(sums, group=group)  # int64 SUM: exact, any order
    values = sums.to(torch.float64) * pow2_clamped(exps - bits)
    total = torch.cumsum(values, dim=0)[-1]  # sequential, in the given order
    total = torch.where((exps == _NONFINITE_EXP).any(), torch.full_like(total, float("nan")), total)
    return total.sqrt().to(torch.float32)


def _square_sum(g: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The definition: sum of round(g**2 * scale) in int64; inf/nan (the norm is nan then) as 0."""
    scaled = g.to(torch.float64).square_().mul_(scale).nan_to_num_(0.0, 0.0, 0.0).round_()
    return scaled.to(torch.int64).sum()  # |sum| <= full numel * 2**P <= 2**62


def clip_sharded_grad_norm_(grads: Sequence[torch.Tensor], max_norm: float, *,
                            full_numels: Sequence[int] | None = None, group=None,
                            replicated: Sequence[bool] | None = None,
                            counted: Sequence[bool] | None = None) -> torch.Tensor:
    """Scale ``grads`` in place by min(1, max_norm / (norm + 1e-6)) of their `sharded_grad_norm`
    (max_norm 0: report only).  Returns the fp32 norm."""
    grads = list(grads)
    norm = sharded_grad_norm(grads, full_numels=full_numels, group=group, replicated=replicated, counted=counted)
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if len({g.device for g in grads}) == 1:
            torch._foreach_mul_(grads, coeff.to(grads[0].device))  # the same products, one call
        else:
            for grad in grads:
                grad.mul_(coeff.to(grad.device))
    return norm


__all__ = ["sharded_grad_norm", "clip_sharded_grad_norm_"]
