"""Communication of the reference recipe: the process group, the expert-parallel dispatcher,
data-parallel gradient reduction and the global gradient norm (`parallelize.py` decides the
layout and uses these; gloo on CPU, NCCL on GPU).

EP runs over the data-parallel replicas ("dp_replicate"): replica r owns experts
[r*E_local, (r+1)*E_local) of each MoE layer, and tokens reach them through two
differentiable `all_to_all_single` calls with uneven splits (dispatch, then combine).  Plain
DP all-reduces the replicas' grads (their mean); an expert's grad already sums every
replica's tokens (the all_to_all's backward brings them home), so it only takes the same
1/dp_replicate scale.  FSDP2 reduce-scatters its own.
"""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from samebits import invariant
from samebits.recipes.model import MoE


def init_process_group(device_type: str = "cpu") -> tuple[int, int, bool]:
    """Join the torchrun group if the environment names one (WORLD_SIZE > 1): gloo for
    "cpu", NCCL for "cuda".

    Returns (rank, world_size, created_here); without torchrun it is (0, 1, False).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1, False
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=5))
    return dist.get_rank(), dist.get_world_size(), True


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` with uneven splits; the backward is the reverse exchange.

    (torch.distributed.nn.functional.all_to_all_single does the same but is deprecated in
    torch 2.13; gloo supports uneven and zero splits, checked by the tests.)
    """

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = rows.new_empty((sum(output_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(input_splits), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), input_splits, output_splits,
                               group=ctx.group)
        return out, None, None, None


@dataclass
class _DispatchHandle:
    send_splits: list[int]
    recv_splits: list[int]
    regroup: torch.Tensor  # received row order -> grouped by local expert
    ungroup: torch.Tensor  # its inverse
    source_counts: torch.Tensor | None = None  # (E_local, W): each local expert's rows per source rank


class ExpertParallelDispatcher:
    """Send expert-sorted rows to the rank owning each expert, and the outputs back."""

    def __init__(self, num_experts: int, world_size: int, group=None, *,
                 shuffle_rows: bool = False):
        self.world_size, self.group = world_size, group
        self.num_local_experts = num_experts // world_size
        self.shuffle_rows = shuffle_rows  # the planted fault fault_ep_dispatch_order

    def dispatch(self, rows, row_prob, tokens_per_expert):
        # (W, E_local): rows this rank sends to each rank, per destination expert.
        send_counts = tokens_per_expert.view(self.world_size, self.num_local_experts)
        recv_counts = torch.empty_like(send_counts)  # (W sources, E_local)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=self.group)
        send_splits = send_counts.sum(dim=1).tolist()  # host sync: split sizes
        recv_splits = recv_counts.sum(dim=1).tolist()
        # The router probability travels with its row (a kernel GEMM may scale by it).
        payload = torch.cat((rows, row_prob.unsqueeze(1).to(rows.dtype)), dim=1)
        received = _AllToAll.apply(payload, recv_splits, send_splits, self.group)
        # Received rows are grouped by source rank, then expert; a stable sort on the key
        # (expert, source) regroups them by expert, then source, keeping each block's order.
        source = torch.arange(self.world_size, device=rows.device).repeat_interleave(
            self.num_local_experts)  # (W*E_local,) source of each received block
        expert = torch.arange(self.num_local_experts, device=rows.device).repeat(self.world_size)
        row_key = (expert * self.world_size + source).repeat_interleave(recv_counts.reshape(-1))
        if self.shuffle_rows:
            # PLANTED FAULT: within each expert, rows in an order drawn from the operating
            # system's entropy (as if regrouped by arrival); the expert weight grads sum
            # their rows in that order.
            entropy = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
            row_key = row_key * len(row_key) + torch.randperm(len(row_key), generator=entropy)
        regroup = torch.argsort(row_key, stable=True)  # unique indices: deterministic backward
        grouped = received.index_select(0, regroup)
        handle = _DispatchHandle(send_splits, recv_splits, regroup, torch.argsort(regroup), recv_counts.t())
        return (grouped[:, :-1], grouped[:, -1].to(row_prob.dtype), recv_counts.sum(dim=0),
                handle)

    def combine(self, rows, handle: _DispatchHandle):
        back = rows.index_select(0, handle.ungroup)
        return _AllToAll.apply(back, handle.send_splits, handle.recv_splits, self.group)


class InvariantExpertGradients:
    """grad_reduce=invariant under EP: the owner of an expert adds, in one backward, the rows
    of every EP rank's current micro-batch.  `GroupedExperts` computes each (expert, source
    rank) segment's weight gradients apart (the ones that micro-batch gives on one rank) and
    hands them here, into one flat fp32 buffer per source (every expert weight of this rank,
    layer after layer); W buffers per backward, M in the step, all on the owner, reduced as
    the accumulator reduces micro-batches (each element its own block, exponent the max over
    the M, int64, decoded once) by `invariant.reduce_blocks` over this rank alone (the native
    passes: one for the exponents, one to encode and add, one to decode): no DP reduction,
    since no other rank holds these experts."""

    def __init__(self, model: nn.Module, num_micro_batches: int, ep: int):
        self.num_micro_batches, self.ep = num_micro_batches, ep
        self.params: list[nn.Parameter] = []
        for module in model.modules():
            if isinstance(module, MoE):
                index = len(self.params)
                module.experts.take_grad = functools.partial(self._take, index)
                self.params += [module.experts.w1, module.experts.w2]
        self.numels = [p.numel() for p in self.params]
        # The reduction runs over this rank alone: a group of one (only its members create it).
        self.own_group = dist.new_group([dist.get_rank()], use_local_synchronization=True)
        self._current: dict[int, list[torch.Tensor]] = {}  # source -> [its flat buffer, a view per weight]
        self._pending: list[torch.Tensor] = []

    def _take(self, index: int, source: int, expert: int, grad_w1: torch.Tensor, grad_w2: torch.Tensor) -> None:
        views = self._current.get(source)
        if views is None:  # this source's first segment in this backward: zeros for the experts it misses
            flat = self._zeros()
            views = self._current[source] = [flat, *(part.view_as(p) for part, p in zip(flat.split(self.numels),
                                                                                        self.params))]
        views[index + 1][expert].copy_(grad_w1)
        views[index + 2][expert].copy_(grad_w2)

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(sum(self.numels), dtype=torch.float32, device=self.params[0].device)

    def micro_batch_done(self) -> None:
        """After each backward: every source's buffer, one contribution each (zeros for a
        source whose rows reached none of these experts)."""
        for source in range(self.ep):
            views = self._current.pop(source, None)
            self._pending.append(self._zeros() if views is None else views[0])

    def reduce(self) -> None:
        if len(self._pending) != self.num_micro_batches:
            raise AssertionError(f"{len(self._pending)} expert gradient parts, expected {self.num_micro_batches}")
        reduced = invariant.reduce_blocks([part.view(-1, 1) for part in self._pending],
                                          num_micro_batches=self.num_micro_batches, group=self.own_group)
        for param, grad in zip(self.params, reduced.view(-1).split(self.numels)):
            param.grad = grad.view_as(param)
        self._pending = []


def reduce_gradients(model: nn.Module, layout) -> None:
    """Complete the TP-partial grads (below), then average grads over the plain-DP replicas
    (one flat all-reduce of the local parts: TP shards stay shards), scale expert grads by
    1/dp_replicate.  FSDP2 reduces its own."""
    _complete_partial_grads(model)
    replicas = layout.dims.dp_replicate
    if replicas == 1:
        return
    dense, experts = [], []
    for name, param in model.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)  # keep the flat buffer layout identical
        (experts if name in layout.expert_param_names else dense).append(local(param.grad))
    flat = torch.cat([g.reshape(-1) for g in dense])
    # gloo sum: bitwise repeatable and equal on all ranks
    dist.all_reduce(flat, group=layout.group("dp_replicate"))
    flat.div_(replicas)
    for grad, part in zip(dense, flat.split([g.numel() for g in dense])):
        grad.copy_(part.view_as(grad))
    for grad in experts:
        grad.div_(replicas)


def _complete_partial_grads(model: nn.Module) -> None:
    """Sum the grads DTensor left Partial over their mesh and make them what their parameter
    is (Replicate): under sequence parallelism a norm's weight is replicated but each TP rank
    back-propagates through its own sequence shard, so its grad is a partial sum.  One flat
    all-reduce per mesh: gloo's sum is bitwise repeatable and equal on every rank.  (FSDP2
    completes the grads of the parameters it manages itself, before its reduce-scatter.)"""
    by_mesh: dict = {}
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            by_mesh.setdefault(grad.device_mesh, []).append(param)
    for mesh, params in by_mesh.items():
        (group,) = [mesh.get_group(i) for i in range(mesh.ndim)]  # the 1-D TP mesh
        grads = [p.grad.to_local() for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for param, grad, part in zip(params, grads, flat.split([g.numel() for g in grads])):
            param.grad = DTensor.from_local(part.view_as(grad).clone(), mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())


def clip_grad_norm(model: nn.Module, layout, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all grads and clip to max_norm.  Returns the norm before clipping
    (0-dim, equal on every rank).  max_norm 0 reports without clipping.

    Each grad counts once over the whole model: grads are grouped by the mesh dimensions
    they are sharded over (none: replicated; "ep": expert shards; a DTensor's Shard
    placements: TP and FSDP2 shards); each group's sum of squares is all-reduced over
    exactly those dimensions, the groups are added in a fixed order, and pipeline stages
    add theirs over "pp".  Every sum has a fixed order, so the norm's bits repeat.  Under
    tp_reduce=invariant or grad_reduce=invariant the norm is
    `samebits.invariant.clip_sharded_grad_norm_`'s, whose bits do not depend on how the
    gradients are split (TP shards, FSDP2 shards, whole on every DP rank).
    """
    if layout.grad_invariant and layout.expert_param_names:
        # EP: expert shards split over the EP group, everything else whole on every rank.
        named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
        experts = [n in layout.expert_param_names for n, _ in named]
        return invariant.clip_sharded_grad_norm_(
            [g for _, g in named], max_norm, group=layout.group("ep"), replicated=[not e for e in experts],
            full_numels=[g.numel() * (layout.dims.ep if e else 1) for (_, g), e in zip(named, experts)])
    if (layout.tp_invariant or layout.grad_invariant) and layout.dims.pp > 1:
        # Every tensor of the whole model in its order, empty on the stages that lack it:
        # each held by one stage, summed over the pipeline.
        held = {n: local(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        grads = [held.get(n, torch.zeros(0, device=layout.device)) for n, _ in layout.full_params]
        return invariant.clip_sharded_grad_norm_(
            grads, max_norm, full_numels=[numel for _, numel in layout.full_params], group=layout.group("pp"),
            replicated=[False] * len(grads))
    if layout.grad_invariant and layout.dims.dp_shard > 1 and layout.dims.tp > 1:
        # FSDP2 over TP shards: every rank's piece summed over the whole world (pp = 1 and
        # dp_replicate = 1 here), a piece replicated over TP only from TP rank 0.
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        first = layout.coords["tp"] == 0
        pieces = [local(g) if first or not _tp_replicated(g) else local(g)[:0].reshape(0) for g in grads]
        norm = invariant.sharded_grad_norm(pieces, full_numels=[g.numel() for g in grads], group=dist.group.WORLD,
                                           replicated=[False] * len(grads))
        if max_norm > 0:  # every local gradient, the TP replicas' too
            coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grad in grads:
                local(grad).mul_(coeff.to(grad.device))
        return norm
    if layout.tp_invariant or layout.grad_invariant:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return invariant.clip_sharded_grad_norm_(
            [local(g) for g in grads], max_norm, full_numels=[g.numel() for g in grads],
            group=layout.shard_group)
    groups: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            names = grad.device_mesh.mesh_dim_names
            # Shard and FSDP2's _StridedShard (which is not a Shard) split the tensor.
            dims = tuple(names[i] for i, p in enumerate(grad.placements)
                         if not (p.is_replicate() or p.is_partial()))
        else:
            dims = ("ep",) if name in layout.expert_param_names else ()
        groups.setdefault(dims, []).append(local(grad))
    total = torch.zeros((), dtype=torch.float32, device=layout.device)
    for dims in sorted(groups, key=lambda d: (len(d), d)):  # () first: the old order
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in groups[dims]])
        part = torch.linalg.vector_norm(norms).square()  # the group's sum of squares
        for dim in dims:
            dist.all_reduce(part, group=layout.group(dim))
        total = total + part  # 0 + x is x: the default layout's bits are unchanged
    if layout.dims.pp > 1:
        dist.all_reduce(total, group=layout.group("pp"))
    norm = total.sqrt()
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grads in groups.values():
            for grad in grads:
                grad.mul_(coeff)
    return norm


def _tp_replicated(grad: torch.Tensor) -> bool:
    """Whether every TP rank holds the same piece of ``grad`` (no "tp" mesh dimension, or
    Replicate on it)."""
    if not isinstance(grad, DTensor):
        return True
    names = grad.device_mesh.mesh_dim_names or ()
    return "tp" not in names or grad.placements[names.index("tp")].is_replicate()


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly DTensor) tensor, as a plain tensor sharing storage."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def any_rank(flag: bool, layout) -> bool:
    """True on every rank if `flag` is True on any rank (all-reduce MAX)."""
    if layout.world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=layout.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def mean_over_ranks(values: torch.Tensor, layout) -> torch.Tensor:
    """Mean over ranks of a small tensor (for the rank-0 log line)."""
    if layout.world_size == 1:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values / layout.world_size
