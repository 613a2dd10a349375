"""Data and expert parallelism for the reference recipe, applied to the model from outside.

Layout (the simple one): the world is one group that is both the data-parallel (DP) and the
expert-parallel (EP) group.  Every rank holds a replica of the dense parameters and
`num_experts / world_size` experts of each MoE layer (rank r owns experts
[r*E_local, (r+1)*E_local)).  Tokens reach their experts through two `all_to_all_single`
calls with uneven splits (dispatch, then combine), both differentiable.

Gradients: dense grads are all-reduced (sum, then divided by the world size: the mean of
the per-rank losses).  An expert's grad already sums the contributions of every rank's
tokens, because the backward of the all_to_all brings them home, so it only needs the same
1/world_size scale and no all-reduce.  gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from samebits.errors import ConfigError
from samebits.recipes.model import MoE, Transformer


@dataclass(frozen=True)
class ParallelLayout:
    rank: int
    world_size: int
    expert_param_names: frozenset[str]  # rank-local parameters (EP shards)
    device: torch.device

    @property
    def coords(self) -> dict[str, int]:
        """This rank's coordinates; DP and EP are the same group in this layout."""
        return {"dp": self.rank, "ep": self.rank}

    @property
    def sizes(self) -> dict[str, int]:
        return {"dp": self.world_size, "ep": self.world_size}


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


class ExpertParallelDispatcher:
    """Send expert-sorted rows to the rank owning each expert, and the outputs back."""

    def __init__(self, num_experts: int, world_size: int, group=None):
        self.world_size, self.group = world_size, group
        self.num_local_experts = num_experts // world_size

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
        regroup = torch.argsort(row_key, stable=True)  # unique indices: deterministic backward
        grouped = received.index_select(0, regroup)
        handle = _DispatchHandle(send_splits, recv_splits, regroup, torch.argsort(regroup))
        return (grouped[:, :-1], grouped[:, -1].to(row_prob.dtype), recv_counts.sum(dim=0),
                handle)

    def combine(self, rows, handle: _DispatchHandle):
        back = rows.index_select(0, handle.ungroup)
        return _AllToAll.apply(back, handle.send_splits, handle.recv_splits, self.group)


def parallelize(model: Transformer, rank: int, world_size: int,
                device: torch.device = torch.device("cpu")) -> ParallelLayout:
    """Shard the experts over the world and install the EP dispatcher (no-op at world 1).

    Call before building the optimizer: the expert parameters are replaced by their local
    slices.  The model must have been initialised identically on every rank.
    """
    expert_names = set()
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        experts = module.experts
        if module.num_experts % world_size:
            raise ConfigError(f"num_experts={module.num_experts} is not divisible by the "
                             f"expert-parallel size {world_size}; choose a multiple")
        expert_names.update(f"{name}.experts.{p}" for p, _ in experts.named_parameters())
        if world_size == 1:
            continue
        local = module.num_experts // world_size
        for pname, param in list(experts.named_parameters()):
            shard = param.detach()[rank * local:(rank + 1) * local].clone()
            setattr(experts, pname, nn.Parameter(shard))
        module.dispatcher = ExpertParallelDispatcher(module.num_experts, world_size)
    return ParallelLayout(rank, world_size, frozenset(expert_names) if world_size > 1
                          else frozenset(), device)


def reduce_gradients(model: nn.Module, layout: ParallelLayout) -> None:
    """Average dense grads over DP (one flat all-reduce), scale expert grads by 1/W."""
    if layout.world_size == 1:
        return
    dense, experts = [], []
    for name, param in model.named_parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)  # keep the flat buffer layout identical
        (experts if name in layout.expert_param_names else dense).append(param.grad)
    flat = torch.cat([g.reshape(-1) for g in dense])
    dist.all_reduce(flat)  # gloo sum: bitwise repeatable and equal on all ranks
    flat.div_(layout.world_size)
    offset = 0
    for grad in dense:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    for grad in experts:
        grad.div_(layout.world_size)


def clip_grad_norm(model: nn.Module, layout: ParallelLayout, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all grads (dense once, every rank's experts) and clip to max_norm.

    Returns the norm before clipping (0-dim).  max_norm 0 reports without clipping.
    """
    dense, experts = [], []
    for name, param in model.named_parameters():
        if param.grad is not None:
            (experts if name in layout.expert_param_names else dense).append(param.grad)

    def sum_of_squares(grads):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=layout.device)
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
        ).square()

    total = sum_of_squares(dense)
    if experts:
        expert_total = sum_of_squares(experts)
        dist.all_reduce(expert_total)
        total = total + expert_total
    norm = total.sqrt()
    if max_norm > 0:
        coeff = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for grad in dense + experts:
            grad.mul_(coeff)
    return norm


def any_rank(flag: bool, layout: ParallelLayout) -> bool:
    """True on every rank if `flag` is True on any rank (all-reduce MAX)."""
    if layout.world_size == 1:
        return flag
    value = torch.tensor([int(flag)], dtype=torch.int32, device=layout.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def mean_over_ranks(values: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Mean over ranks of a small tensor (for the rank-0 log line)."""
    if layout.world_size == 1:
        return values
    values = values.clone()
    dist.all_reduce(values)
    return values / layout.world_size
