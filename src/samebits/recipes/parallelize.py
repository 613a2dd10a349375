"""Apply the recipe's parallelism to a model from outside (torchtitan's split: model.py holds
the architecture, this file the parallelism), on PyTorch's own engines.

    dims = ParallelDims.resolve(cfg, world_size)        # sizes, validated against the world
    layout = parallelize(model, cfg, rank, world_size, device)

A named `DeviceMesh` ("pp", "dp_replicate", "dp_shard", "tp"); TP by DTensor
`parallelize_module` (Megatron's split; the fused QKV is head-major, so a column shard holds
whole heads), with sequence parallelism (`_sequence_parallel_plan`) or, under
`tp_reduce=invariant`, `samebits.invariant`'s layers (`apply_invariant_linears`); FSDP2's
`fully_shard` over "dp_shard"; EP through `communication.py`'s all_to_all dispatcher over
"dp_replicate"; PP by `torch.distributed.pipelining`, each stage a pruned copy of the full
model, so parameter names are the full model's on every layout.  Plain DP's all-reduce is in
`communication.py`; the sizes and cell names in `cells.py`.  docs/recipe.md ("Parallelism")
has the table of engines and why context parallelism is not offered (torch's needs the CUDA
SDPA backends).  The planted faults (`fault_*` switches) live here too: each is a small
change to one engine, named in docs/recipe.md.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from samebits.invariant import (InvariantReduceScatter, column_parallel_linear, manual_seed, micro_batch_seed,
                                row_parallel_linear, scale_columns)
from samebits.recipes.cells import AXES, ParallelDims, mesh_axes
from samebits.recipes.config import RecipeConfig
from samebits.recipes.model import MLP, MoE, Block, Transformer
from samebits.recipes.communication import ExpertParallelDispatcher, local

# --- the layout ----------------------------------------------------------------------------


@dataclass
class ParallelLayout:
    """What one rank holds and which groups it talks to."""

    rank: int
    world_size: int
    dims: ParallelDims
    device: torch.device
    mesh: DeviceMesh | None = None
    expert_param_names: frozenset[str] = frozenset()  # EP shards: rank-local parameters
    pipeline: Pipeline | None = None
    sequence_parallel: bool = False  # the TP ranks hold sequence shards of the stream
    tp_invariant: bool = False  # tp_reduce=invariant: TP linears and the clipping norm split-invariant
    grad_invariant: bool = False  # grad_reduce=invariant: DP sums (plain DP, FSDP2) in int64 fixed point
    block_keys: BlockKeys | None = None  # grad_reduce=invariant: each block's draws keyed by (step, micro-batch)
    full_params: tuple[tuple[str, int], ...] = ()  # under PP: every parameter of the whole model (name, numel)

    @property
    def coords(self) -> dict[str, int]:
        return self.dims.coords(self.rank)

    @property
    def checkpoint_layout(self) -> dict[str, int]:
        """What a checkpoint stores as its layout (loading under another one is refused):
        {"dp", "ep"} as before the mesh, plus "dp_shard", "tp" and "pp" where > 1, and
        "sequence_parallel": 1 under TP with SP (its norms are DTensors: other state)."""
        dims = self.dims
        extra = {"dp_shard": dims.dp_shard, "tp": dims.tp, "pp": dims.pp}
        layout = {"dp": dims.dp, "ep": dims.ep, **{k: v for k, v in extra.items() if v > 1}}
        return {**layout, "sequence_parallel": 1} if self.sequence_parallel else layout

    @property
    def expert_group(self):
        """The group EP shards are split over (None without EP): global digests sum them."""
        return self.group("ep") if self.expert_param_names else None

    def group(self, dim: str):
        """The process group of mesh dimension `dim`, or of the one an axis runs over ("ep" is
        "dp_replicate")."""
        over = {axis.field: axis.over for axis in AXES if axis.over is not None}
        return self.mesh.get_group(over.get(dim, dim))

    @property
    def dp_group(self):
        """The data-parallel group: FSDP2's or plain DP's (a group of one at dp=1 among several
        ranks); None at world size 1 (no mesh: this process alone)."""
        if self.mesh is None:
            return None
        return self.group("dp_shard" if self.dims.dp_shard > 1 else "dp_replicate")

    @property
    def shard_group(self):
        """The group the parameters are split over, for the invariant clipping norm: TP's, or
        FSDP2's (the invariant modes never combine the two); None when every rank holds them
        whole."""
        if self.dims.tp > 1:
            return self.group("tp")
        return self.group("dp_shard") if self.dims.dp_shard > 1 else None


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The named mesh of `cells.mesh_axes`, outermost first as torchtitan ("pp", "dp_replicate",
    "dp_shard", "tp"; size-1 dimensions included, so every name always exists)."""
    return init_device_mesh(device_type, dims.mesh_shape(), mesh_dim_names=tuple(axis.field for axis in mesh_axes()))


def parallelize(model: Transformer, cfg: RecipeConfig, rank: int, world_size: int,
                device: torch.device = torch.device("cpu")) -> ParallelLayout:
    """Apply EP, TP, PP and FSDP2 to `model` (initialised identically on every rank), in
    torchtitan's order; call before building the optimizer (parameters are replaced).

    At world size 1 nothing changes."""
    dims = ParallelDims.resolve(cfg, world_size)
    layout = ParallelLayout(rank, world_size, dims, device, tp_invariant=cfg.tp_reduce == "invariant",
                            grad_invariant=cfg.grad_reduce == "invariant")
    if layout.tp_invariant and dims.tp == 1:
        apply_invariant_linears(model, None)  # the layer math of every TP degree, on one rank
    elif layout.grad_invariant and not layout.tp_invariant:
        _enter_blocks_through_one_node(model)
    if layout.grad_invariant:
        layout.block_keys = BlockKeys(model, cfg.seed)
        for moe in model.moe_layers():  # on every layout: the expert GEMMs EP needs (model.py)
            moe.experts.invariant = True
    if dims.pp > 1:
        layout.full_params = tuple((n, p.numel()) for n, p in model.named_parameters())
    if world_size == 1:
        return layout
    layout.mesh = build_mesh(dims, device.type)
    coords = dims.coords(rank)
    layout.expert_param_names = _shard_experts(model, dims, coords["ep"], layout, cfg)
    if dims.pp > 1:
        _prune_to_stage(model, coords["pp"], dims.pp)
    if dims.tp > 1:
        layout.sequence_parallel = cfg.sequence_parallel
        if layout.tp_invariant:
            apply_invariant_linears(model, layout.mesh["tp"], sequence_parallel=cfg.sequence_parallel,
                                    dropout=cfg.dropout)
        else:
            apply_tensor_parallel(model, layout.mesh["tp"], racy=cfg.fault_tp_racy_accumulate,
                                  sequence_parallel=cfg.sequence_parallel, dropout=cfg.dropout)
    model.to(device)
    if dims.dp_shard > 1:
        apply_fsdp(model, layout.mesh["dp_shard"],
                   num_micro_batches=cfg.num_micro_batches if layout.grad_invariant else None)
    if dims.pp > 1:
        # grad_reduce=invariant: the pipeline's micro-batches are this DP rank's share of the
        # step's num_micro_batches, one pipeline micro-batch each.
        chunks = cfg.num_micro_batches // dims.dp if layout.grad_invariant else cfg.pp_microbatches
        rows = chunks * cfg.micro_batch_size if layout.grad_invariant else cfg.micro_batch_size
        layout.pipeline = Pipeline(model, cfg, coords["pp"], dims.pp, device,
                                   layout.mesh.get_group("pp"), num_chunks=chunks, batch_rows=rows)
    return layout


def _shard_experts(model: Transformer, dims: ParallelDims, ep_rank: int, layout, cfg) -> frozenset:
    """Keep this rank's experts of each MoE layer and install the all_to_all dispatcher."""
    if dims.ep == 1:
        return frozenset()
    names = set()
    for name, module in model.named_modules():
        if not isinstance(module, MoE):
            continue
        local = module.num_experts // dims.ep
        for pname, param in list(module.experts.named_parameters()):
            shard = nn.Parameter(param.detach()[ep_rank * local:(ep_rank + 1) * local].clone())
            # Megatron's shard attributes: global digests sum the shards over the EP group.
            shard.tensor_model_parallel, shard.partition_dim, shard.partition_stride = True, 0, 1
            setattr(module.experts, pname, shard)
            names.add(f"{name}.experts.{pname}")
        module.dispatcher = ExpertParallelDispatcher(
            module.num_experts, dims.ep, group=layout.group("ep"),
            shuffle_rows=cfg.fault_ep_dispatch_order)
    return frozenset(names)


# --- tensor parallelism --------------------------------------------------------------------


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, *, racy: bool = False,
                          sequence_parallel: bool = False, dropout: float = 0.0) -> None:
    """Megatron's split on every block (and MTP block): QKV and MLP up column-parallel,
    attention output and MLP down row-parallel.  The embedding, router, experts and the
    output layer stay replicated.

    Without sequence parallelism the residual stream, and so the norms, is replicated on the
    TP ranks.  With it (torchtitan's plan) the stream of the main blocks is sharded along the
    sequence (Shard(1)): see `_sequence_parallel_plan`."""
    blocks = [m for m in model.layers.values()]
    mtp_blocks = [m.block for m in (model.mtp or [])]
    for block in blocks + mtp_blocks:
        sharded = sequence_parallel and block in blocks
        parallelize_module(block, tp_mesh, _sequence_parallel_plan(block) if sharded
                           else _tensor_parallel_plan(block))
        if sharded and dropout > 0:
            _shard_dropout(block, tp_mesh, dropout)
        if racy:
            for row_parallel in [block.attn.out] + ([block.ffn.down] if isinstance(block.ffn, MLP) else []):
                row_parallel.forward = _RacyRowParallel(row_parallel)
    if sequence_parallel:
        # The stream enters the sequence shards at the first block; a pipeline stage passes
        # its shard on.  Without MTP the head is sequence-parallel too (torchtitan's): the
        # final norm on the shard, the output layer column-parallel over the vocabulary,
        # gathering its input and its logits.  With MTP the stream leaves the shards after
        # the last block: a depth d pairs position t with t + d, across shard boundaries.
        held = dict(model.layers.items())  # a pipeline stage holds some of the blocks
        first, last = held.get("0"), held.get(str(model.cfg.num_layers - 1))
        if first is not None:
            parallelize_module(first, tp_mesh, PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                use_local_output=True))
        if last is not None and model.cfg.mtp_num_layers == 0:
            parallelize_module(model, tp_mesh, {
                "norm": SequenceParallel(),
                "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        elif last is not None:
            parallelize_module(last, tp_mesh, PrepareModuleOutput(
                output_layouts=(Shard(1), None), desired_output_layouts=(Replicate(), None),
                use_local_output=True))


def _tensor_parallel_plan(block: Block) -> dict[str, Any]:
    """Megatron TP alone: the block's input and output are replicated on the TP ranks."""
    plan: dict[str, Any] = {"attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel()}
    if isinstance(block.ffn, MLP):
        plan.update({"ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()})
    return plan


def apply_invariant_linears(model: Transformer, tp_mesh: DeviceMesh | None, *,
                            sequence_parallel: bool = False, dropout: float = 0.0) -> None:
    """`tp_reduce=invariant`: Megatron's split of `_tensor_parallel_plan`, each linear computed
    by `samebits.invariant`'s column- or row-parallel layer, whose forward and backward have
    the same bits at every TP degree (docs/invariance.md).  The weights become DTensor shards
    as under plain TP (the same placements for checkpoints, digests and the norm); activations
    between the two linears are plain local tensors.  ``tp_mesh`` None (tp=1): the same
    layers, whole, on one rank.  The main blocks' norms scale through `scale_columns`, whose
    weight gradient is an exact sum over the positions (under SP, the TP ranks' too).  With
    ``sequence_parallel`` the stream between the blocks' parts is this rank's positions: each
    part's input all-gathered (its backward keeps this rank's part of a gradient already whole
    and exact), its output sliced, dropout drawn whole and sliced; the head runs on the whole
    sequence, replicated."""
    group = None if tp_mesh is None else tp_mesh.get_group()
    sharded = sequence_parallel and tp_mesh is not None
    blocks = list(model.layers.values())
    for block in [*blocks, *(m.block for m in (model.mtp or []))]:
        main = block in blocks
        for name, style in _tensor_parallel_plan(block).items():
            linear = block.get_submodule(name)
            column = isinstance(style, ColwiseParallel)
            if tp_mesh is not None:
                linear.weight = nn.Parameter(distribute_tensor(
                    linear.weight.detach(), tp_mesh, [Shard(0 if column else 1)]))
            linear.forward = _InvariantLinear(linear, column, group,
                                              slice_output=sharded and main and not column)
        if not main:
            continue
        for norm in (block.attn_norm, block.ffn_norm):
            norm.forward = _InvariantNorm(norm, group if sharded else None)
        if sharded:
            for part in (block.attn, block.ffn):
                part.register_forward_pre_hook(lambda _m, args: (_GatherSequence.apply(args[0], group), *args[1:]))
            if isinstance(block.ffn, MoE):  # the dense MLP's down projection slices its own output
                block.ffn.register_forward_hook(lambda _m, _a, out: (_SliceSequence.apply(out[0], group), *out[1:]))
            if dropout > 0:
                _shard_dropout(block, tp_mesh, dropout)
    # The stream enters and leaves the blocks through one autograd node at every layout (the
    # identity without SP): the embeddings' gradient then adds its parts (the blocks', MTP's)
    # in the same grouping whether or not the blocks ran on sequence shards.
    stream_group = group if sharded else None
    held = dict(model.layers.items())
    first, last = held.get("0"), held.get(str(model.cfg.num_layers - 1))
    if first is not None:
        first.register_forward_pre_hook(lambda _m, args: (_SliceSequence.apply(args[0], stream_group), *args[1:]))
    if last is not None:
        last.register_forward_hook(lambda _m, _a, out: (_GatherSequence.apply(out[0], stream_group), *out[1:]))


class BlockKeys:
    """grad_reduce=invariant: each block's random draws (dropout from torch's global RNG, an
    MoE layer's router jitter) come from a stream keyed by (seed, step, micro-batch, block),
    seeded by a forward pre-hook on every block of the whole model (MTP's too, numbered after
    the layers), so a pipeline stage draws for its blocks what one rank draws for them.
    ``with keys.micro_batch(step, index):`` around a micro-batch's forward; outside it the
    blocks draw from the streams as they are (the pipeline's warm-up)."""

    def __init__(self, model: Transformer, seed: int):
        self.seed, self.current = seed, None
        blocks = [*model.layers.values(), *(m.block for m in (model.mtp or []))]
        for ordinal, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda module, _args, ordinal=ordinal: self._seed(module, ordinal))

    @contextlib.contextmanager
    def micro_batch(self, step: int, index: int):
        self.current = (step, index)
        try:
            yield
        finally:
            self.current = None

    def _seed(self, block: Block, ordinal: int) -> None:
        if self.current is None:
            return
        key = micro_batch_seed(self.seed, *self.current)
        manual_seed(micro_batch_seed(key, ordinal, 0))
        if isinstance(block.ffn, MoE) and block.ffn.jitter_generator is not None:
            block.ffn.jitter_generator.manual_seed(micro_batch_seed(key, ordinal, 1))


def _enter_blocks_through_one_node(model: Transformer) -> None:
    """grad_reduce=invariant: the stream enters the first block through one autograd node at
    every layout (an identity; apply_invariant_linears has its own).  FSDP2 puts a node there
    (its post-backward hook on the block's inputs), so the embeddings' gradient adds the
    first block's two parts (residual, norm) before MTP's; without a node of our own, one
    rank adds the three in another grouping (measured: fsdp2 differed from one rank at step 0
    in embed.weight only)."""
    first = dict(model.layers.items()).get("0")
    if first is not None:
        first.register_forward_pre_hook(lambda _m, args: (_SliceSequence.apply(args[0], None), *args[1:]))


# The products of the invariant TP linears: "gemm" (platform fp32 GEMM leaves in one fixed tree,
# the default) or "exact" (exact block products, about 20x slower on a CPU; no platform
# measurement behind it).  Every layout compared must run the same mode (benchmarks switch it).
TP_MATMUL_MODE = "gemm"


class _InvariantLinear:
    """The forward of one TP linear under `tp_reduce=invariant` (bias-free, as the recipe's);
    ``slice_output``: keep this rank's positions of the row-parallel output (SP)."""

    def __init__(self, linear: nn.Linear, column: bool, group, *, slice_output: bool = False):
        self.linear, self.group, self.slice_output = linear, group, slice_output
        self.layer = column_parallel_linear if column else row_parallel_linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # to_local keeps autograd: the weight's grad comes back as a DTensor of its placement.
        out = self.layer(x, local(self.linear.weight), self.group, mode=TP_MATMUL_MODE)
        return _SliceSequence.apply(out, self.group) if self.slice_output else out


class _InvariantNorm:
    """RMSNorm as the normalisation (per position) times `scale_columns` by its weight."""

    def __init__(self, norm: nn.RMSNorm, group):
        self.norm, self.group = norm, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        normalized = F.rms_norm(x, norm.normalized_shape, None, norm.eps)
        return scale_columns(normalized, norm.weight, self.group)


class _SliceSequence(torch.autograd.Function):
    """(B, T, ...) whole on every TP rank -> this rank's T / tp positions; backward all-gathers.
    ``group`` None: the identity (one autograd node all the same)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _slice_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class _GatherSequence(torch.autograd.Function):
    """This rank's positions -> the whole sequence; backward keeps this rank's positions of a
    gradient that is whole and the same on every TP rank (its consumers sum exactly)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _slice_sequence(grad, ctx.group), None


def _slice_sequence(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x.clone()
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    part = x.shape[1] // size
    return x[:, rank * part:(rank + 1) * part].contiguous()


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _sequence_parallel_plan(block: Block) -> dict[str, Any]:
    """TP with sequence parallelism (torchtitan's llama plan): the block's input and output
    are this rank's seq_len / tp positions (plain tensors, Shard(1) of the stream).

    The norms run on the shard (`SequenceParallel`: their weights become Replicate DTensors,
    whose gradients DTensor all-reduces); attention and the dense MLP all-gather their input
    (`PrepareModuleInput` Shard(1) -> Replicate, Megatron's "g") and their row-parallel output
    projection reduce-scatters (`RowwiseParallel(output_layouts=Shard(1))`) instead of
    all-reducing.  An MoE layer routes the whole sequence, replicated as without SP (router,
    jitter and experts see the same rows on every TP rank, EP included): its input is
    all-gathered and its output sliced back to the shard (the slice's backward all-gathers
    the gradient, so every TP rank back-propagates the same full gradient)."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    plan: dict[str, Any] = {
        "attn_norm": SequenceParallel(), "attn": gather,
        "attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if isinstance(block.ffn, MLP):
        plan.update({"ffn": gather, "ffn.up": ColwiseParallel(),
                     "ffn.down": RowwiseParallel(output_layouts=Shard(1))})
    else:
        plan["ffn"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None),
            use_local_output=True)
    return plan


def _shard_dropout(block: Block, tp_mesh: DeviceMesh, rate: float) -> None:
    """The block's residual dropout on a sequence shard, with the mask of the whole stream:
    each TP rank draws the full (B, T, D) mask from the global RNG (the same state on every
    TP rank) and keeps its rows, so the shards get different masks, the RNG advances as
    without SP (the replicated MTP block after the layers still draws equal masks on the TP
    ranks), and the masks are those the same run without SP draws.  The block's own dropout
    is switched off (rate 0 draws nothing) and the attention and feed-forward outputs, this
    rank's shard after the row-parallel reduce-scatter, are dropped out by forward hooks."""
    tp_rank, tp_size = tp_mesh.get_local_rank(), tp_mesh.size()

    def drop(_module, _inputs, output):
        out, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, None)
        if _module.training:
            batch, seq_len, dim = out.shape  # (B, T/tp, D)
            keep = torch.empty(batch, seq_len * tp_size, dim, dtype=out.dtype,
                               device=out.device).bernoulli_(1 - rate).div_(1 - rate)
            out = out * keep[:, tp_rank * seq_len:(tp_rank + 1) * seq_len]
        return out if rest is None else (out, *rest)

    block.dropout = 0.0
    block.attn.register_forward_hook(drop)
    block.ffn.register_forward_hook(drop)


class _RacyRowParallel:
    """PLANTED FAULT (fault_tp_racy_accumulate): a row-parallel linear whose local product
    x_local @ w_local.T is summed over its input dimension in chunks, in an order drawn from
    the operating system's entropy on each call, as a kernel adding partial sums in arrival
    order would.  The partial result then goes through the usual TP all-reduce (the
    reduce-scatter under sequence parallelism)."""

    NUM_CHUNKS = 8

    def __init__(self, linear: nn.Linear):
        self.linear = linear

    def __call__(self, x: DTensor) -> DTensor:
        x_local, w_local = x.to_local(), self.linear.weight.to_local()  # (..., K/tp), (N, K/tp)
        chunks = torch.arange(x_local.shape[-1]).chunk(self.NUM_CHUNKS)
        order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(
            int.from_bytes(os.urandom(8), "little") >> 1))
        partial = None
        for i in order.tolist():
            term = x_local[..., chunks[i]] @ w_local[:, chunks[i]].T
            partial = term if partial is None else partial + term
        return DTensor.from_local(partial, x.device_mesh, [Partial()], run_check=False)


# --- FSDP2 ------------------------------------------------------------------------------------


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, num_micro_batches: int | None = None) -> None:
    """`fully_shard` each block and MTP module, then the root (embedding, norm, output).

    ``num_micro_batches`` (grad_reduce=invariant): every module's gradient reduce-scatter is
    `samebits.invariant.InvariantReduceScatter` (an int64 sum of the step's micro-batches,
    each element its own block: the same bits as plain DP and one rank), with FSDP2's divide
    factor 1 (the loss is already divided by the global count)."""
    modules = [*model.layers.values(), *(model.mtp or [])]
    for module in modules:
        fully_shard(module, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    if num_micro_batches is not None:
        for module in [*modules, model]:
            module.set_custom_reduce_scatter(InvariantReduceScatter(num_micro_batches, group=dp_mesh.get_group()))
            module.set_gradient_divide_factor(1.0)


# --- pipeline parallelism --------------------------------------------------------------------


def stage_layers(num_layers: int, num_stages: int, stage: int) -> list[int]:
    """Contiguous blocks of `stage`; earlier stages take one more when they do not divide."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (stage < extra)))


def _prune_to_stage(model: Transformer, stage: int, num_stages: int) -> None:
    """Delete what this stage does not run (as torchtitan): other blocks, the embedding on
    later stages, the final norm, output layer and MTP on earlier ones."""
    keep = {str(i) for i in stage_layers(model.cfg.num_layers, num_stages, stage)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage > 0:
        model.embed = None
    if stage < num_stages - 1:
        model.norm, model.output, model.mtp = None, None, None


class _StageModule(nn.Module):
    """One stage's forward over tensors: the first takes token ids, later ones take
    (hidden, embedded, load-balancing sum); the last returns (logits, load-balancing loss,
    *mtp_logits).  The embeddings travel with the hidden state because MTP reads them."""

    def __init__(self, model: Transformer, first: bool, last: bool):
        super().__init__()
        self.model, self.first, self.last = model, first, last

    def forward(self, *inputs: torch.Tensor):
        if self.first:
            (tokens,) = inputs
            embedded = self.model.embed_tokens(tokens)
            h, aux_sum = embedded, embedded.new_zeros(1)
        else:
            h, embedded, aux_sum = inputs
        h, aux_sum = self.model.run_layers(h, aux_sum)
        if not self.last:
            return h, embedded, aux_sum
        out = self.model.head(h, embedded, aux_sum)
        return (out.logits, out.load_balancing_loss.reshape(1), *out.mtp_logits)


@dataclass
class Pipeline:
    """This rank's stage and its schedule; `run(tokens, loss_fn)` does one step's forward
    and backward over the micro-batches."""

    model: Transformer
    cfg: RecipeConfig
    stage_index: int
    num_stages: int
    device: torch.device
    group: Any
    num_chunks: int = 0  # pipeline micro-batches per step (0: cfg.pp_microbatches)
    batch_rows: int = 0  # samples per step through this pipeline (0: cfg.micro_batch_size)
    stage: PipelineStage = field(init=False)
    _stash: dict = field(init=False, default_factory=dict)
    _schedule: Any = field(init=False, default=None)
    _loss_fn: Any = field(init=False, default=None)

    def __post_init__(self):
        cfg, self.first, self.last = self.cfg, self.stage_index == 0, self.stage_index == self.num_stages - 1
        self.stage = PipelineStage(_StageModule(self.model, self.first, self.last), self.stage_index,
                                   self.num_stages, self.device, group=self.group)
        if cfg.fault_pp_reorder_microbatch_grads and self.last:
            for param in self.model.parameters():
                param.register_post_accumulate_grad_hook(self._stash_grad)
        schedule_cls = ScheduleGPipe if cfg.pp_schedule == "gpipe" else Schedule1F1B
        self.num_chunks = self.num_chunks or cfg.pp_microbatches
        self._schedule = schedule_cls(
            self.stage, self.num_chunks, scale_grads=False,
            loss_fn=lambda outputs, target: self._loss_fn(outputs, target))
        self._warm_up(torch.zeros(self.batch_rows or cfg.micro_batch_size, cfg.seq_len + 1, dtype=torch.int64,
                                  device=self.device))

    def _stash_grad(self, param: torch.Tensor) -> None:
        """PLANTED FAULT (fault_pp_reorder_microbatch_grads): keep each micro-batch's gradient
        apart; `_accumulate_reversed` then adds them last micro-batch first."""
        self._stash.setdefault(param, []).append(param.grad)
        param.grad = None

    def _accumulate_reversed(self) -> None:
        for param, grads in self._stash.items():
            param.grad = functools.reduce(torch.add, reversed(grads))  # ((g_n + g_n-1) + ...) + g_1
        self._stash.clear()

    def run(self, tokens: torch.Tensor, loss_fn: Callable) -> None:
        """Forward and backward of one step: `tokens` (B, T+1) split into the configured
        number of micro-batches; `loss_fn(outputs, tokens)` runs on the last stage and its
        gradients add up over micro-batches (it divides by their number itself)."""
        self._loss_fn = loss_fn
        self._step(tokens)
        if self._stash:
            self._accumulate_reversed()

    def run_keyed(self, tokens: torch.Tensor, loss_fn: Callable, forward_context: Callable,
                  after_backward: Callable) -> None:
        """`run`, with pipeline micro-batch i's forward on this stage inside
        ``forward_context(i)`` and ``after_backward(i)`` called after its backward
        (grad_reduce=invariant: the micro-batch's keys, then the accumulator takes its
        gradients)."""
        stage = self.stage
        forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

        def keyed_forward(chunk_id, *args, **kwargs):
            with forward_context(chunk_id):
                return forward(chunk_id, *args, **kwargs)

        def taken_backward(chunk_id, *args, **kwargs):
            out = backward(chunk_id, *args, **kwargs)
            after_backward(chunk_id)
            return out

        stage.forward_one_chunk, stage.backward_one_chunk = keyed_forward, taken_backward
        try:
            self.run(tokens, loss_fn)
        finally:
            del stage.forward_one_chunk, stage.backward_one_chunk  # the class's methods again

    def _step(self, tokens: torch.Tensor) -> None:
        args = (tokens[:, :-1],) if self.first else ()
        self._schedule.step(*args, **({"target": tokens} if self.last else {}))

    def _warm_up(self, tokens: torch.Tensor) -> None:
        """One throwaway step on zero tokens when the pipeline is built, leaving no trace:
        torch's pipelining infers the stages' shapes on its first step by running the stage
        forward (and the loss) on real tensors, which draws dropout and router-jitter random
        numbers.  Doing that here, with every random state restored and the gradients
        dropped, makes the first real step draw (and record) exactly what a step of a longer
        run does, a resumed run's too."""
        generators = {id(m.jitter_generator): m.jitter_generator for m in self.model.moe_layers()
                      if m.jitter_generator is not None}
        saved = {key: gen.get_state() for key, gen in generators.items()}
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            self._loss_fn = lambda outputs, target: sum(o.sum() for o in outputs) * 0.0
            self._step(torch.zeros_like(tokens))
        for key, gen in generators.items():
            gen.set_state(saved[key])
        self._stash.clear()
        self.model.zero_grad(set_to_none=True)

    def broadcast_from_last(self, values: torch.Tensor) -> torch.Tensor:
        """The last stage's `values` on every stage of this pipeline."""
        dist.broadcast(values, group=self.group, group_src=self.num_stages - 1)
        return values


# --- checkpoints of sharded state --------------------------------------------------------------


def sharded_names(model: nn.Module) -> frozenset[str]:
    """Names of the parameters held as DTensors (TP and FSDP2 shards)."""
    return frozenset(n for n, p in model.named_parameters() if isinstance(p, DTensor))


class LocalShardsModel:
    """The model as `samebits.checkpoint` sees it: `state_dict()` holds each DTensor's local
    shard as a plain tensor (saved rank-locally, bit for bit, whatever the placement, FSDP2's
    _StridedShard included), and `load_state_dict` copies them back into the shards.  The
    checkpoint refuses another layout, so a shard always loads where it was saved."""

    def __init__(self, model: nn.Module):
        self.model = model

    def named_parameters(self):
        return self.model.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: local(v) for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = False):
        live = self.model.state_dict()
        missing = sorted(set(live) - set(state))
        unexpected = sorted(set(state) - set(live))
        with torch.no_grad():
            for name in set(live) & set(state):
                local(live[name]).copy_(state[name])
        return missing, unexpected


class LocalShardsOptimizer:
    """The optimizer as `samebits.checkpoint` sees it: state of DTensor parameters as plain
    local shards; `load_state_dict` wraps them back into DTensors of their parameter's
    placement before torch's own `load_state_dict`."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self) -> dict:
        state_dict = self.optimizer.state_dict()
        state = {i: {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                 for i, entry in state_dict["state"].items()}
        return {**state_dict, "state": state}

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        state = {index: {k: _like_param(v, params[index]) for k, v in entry.items()}
                 for index, entry in state_dict["state"].items()}
        self.optimizer.load_state_dict({**state_dict, "state": state})


def _like_param(value: Any, param: torch.Tensor) -> Any:
    """A loaded local shard as a DTensor laid out like `param` (other values unchanged)."""
    if not (isinstance(param, DTensor) and isinstance(value, torch.Tensor)
            and value.shape == param.to_local().shape and value.dim() > 0):
        return value
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())
