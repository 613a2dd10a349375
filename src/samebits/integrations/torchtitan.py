"""torchtitan 0.3.0: the same bits at any data- and tensor-parallel layout, as a config (docs/integrations.md).

    from samebits.integrations.torchtitan import invariant

    def my_model_invariant():            # --module my_configs --config my_model_invariant
        return invariant(my_model())     # my_model(): any torchtitan Trainer.Config

`invariant` returns the same config whose trainer (`InvariantTrainer`, a torchtitan `Trainer`,
through its own `Config.build`) makes the step independent of how the ranks split it: every
rank reads the one global stream of micro-batches and trains its data-parallel share of it;
each FSDP2 unit's gradient reduction is the invariant int64 fixed point (`_UnitSum`: FSDP2's
custom reduce-scatter on 2+ shards, its post-reduce hook on one rank and for HSDP replicas);
the model config's linears and RMSNorms become `InvariantLinear` and `InvariantRMSNorm`, whose
products and sums have the same bits at any tensor-parallel degree, sequence parallelism
included; the clipping norm is the sharded invariant norm; the initial weights are made whole,
once, from ``debug.seed``, and each rank keeps its slice; any draw is keyed by (step,
micro-batch).  What it does not cover (pipeline, context and expert parallelism; TP off the
partial_dtensor backend; HSDP with both replicas and shards; float8; FlexAttention on a CPU)
it refuses at start, naming the reason.

``SAMEBITS_LAYOUT`` (a cell: ``single``, ``fsdp2``, ``dp2``...) sets the parallel degrees and
``SAMEBITS_INVARIANT=0`` keeps only the layout: `samebits verify --across` sets both, for the
layouts and their negative controls (docs/integrations.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
import spmd_types as spmd
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.quantization.utils import has_quantization
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.parallel_dims import MeshAxisName, SpmdLayout
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.tools.utils import set_default_dtype
from torchtitan.trainer import Trainer

from samebits import settings
from samebits.errors import ConfigError
from samebits.invariant import (MAX_LEAVES, TP_BLOCK_SIZE, clip_sharded_grad_norm_, column_parallel_linear,
                                gather_columns, manual_seed, micro_batch_seed, reduce_blocks, row_parallel_linear,
                                scale_columns)
from samebits.runners.commands import INVARIANT_VARIABLE, LAYOUT_VARIABLE, cell_degrees

_OWNER = "samebits.integrations.torchtitan"
_WRAPPERS = re.compile(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.")


def invariant(config: Trainer.Config, *, layout: str | None = None, tensor_parallel: bool = True) -> Trainer.Config:
    """``config`` (torchtitan's `Trainer.Config`) at ``layout`` (None: ``SAMEBITS_LAYOUT``, or as
    it is), trained by `InvariantTrainer` unless ``SAMEBITS_INVARIANT`` is 0 (the control).
    ``tensor_parallel=False`` keeps torchtitan's own layers: the same bits at any data-parallel
    layout only, for less (tensor parallelism is then refused)."""
    layout = layout if layout is not None else settings.read(LAYOUT_VARIABLE)
    if layout:
        set_layout(config, layout)
    if not settings.read(INVARIANT_VARIABLE):
        return config
    if tensor_parallel and config.model_spec is not None:
        _invariant_layers(config.model_spec.model)
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return InvariantTrainer.Config(**values)


def set_layout(config: Trainer.Config, cell: str) -> None:
    """Set torchtitan's parallel degrees from a cell: ``single``, or parts joined by ``-`` of
    ``fsdpN`` (FSDP2 over N ranks), ``dpN`` (replicas), ``tpN``, ``ppN``, ``cpN``."""
    try:
        degrees = cell_degrees(cell)
    except ConfigError as err:
        raise ConfigError(f"{_OWNER}: {err}") from None
    p = config.parallelism
    p.data_parallel_shard_degree = degrees["fsdp"]
    p.data_parallel_replicate_degree = degrees["dp"]
    p.tensor_parallel_degree = degrees["tp"]
    p.pipeline_parallel_degree = degrees["pp"]
    p.context_parallel_degree = degrees["cp"]


# --- tensor and sequence parallelism: the layers, given to torchtitan by its model config ----

def _tp_group(mesh):
    """The tensor-parallel process group of a DTensor's mesh (None: one rank, no collective)."""
    names = mesh.mesh_dim_names or ()
    sub = mesh["tp"] if "tp" in names and len(names) > 1 else mesh
    return sub.get_group() if sub.size() > 1 else None


def _tp_placement(sharding_config) -> Any:
    """The TP placement a module's sharding config gives its weight (None: not declared)."""
    layout = None if sharding_config is None else (sharding_config.state_shardings or {}).get("weight")
    return None if layout is None else layout.per_axis_spmd_types().get(MeshAxisName.TP)


class InvariantLinear(Linear):
    """torchtitan's `Linear` (no bias) with the same bits at any TP degree: a weight its sharding
    config splits by rows (ColwiseParallel) is `column_parallel_linear`, by columns (RowwiseParallel)
    `row_parallel_linear`, at every layout, one rank included (the products over a split
    dimension are the same fixed tree there).  The row layer's sum is whole on every rank, so its
    output is Replicate (the framework's reduce-scatter becomes a local slice: exact), and
    ``gather_output`` (the LM head) joins the vocabulary blocks so the loss is computed whole."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        gather_output: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.gather_output = config.gather_output

    def _role(self) -> str:
        """"column", "row" or "whole" (a weight no TP plan splits), from the sharding config."""
        dim = getattr(_tp_placement(self._sharding_config), "dim", None)
        if dim not in (None, 0, 1):
            raise ConfigError(f"{_OWNER}: a linear layer ({self.in_features} -> {self.out_features}) whose TP plan "
                              f"shards its weight on dimension {dim} is neither column- nor row-parallel: not covered")
        return {None: "whole", 0: "column", 1: "row"}[dim]

    def parallelize(self, parallel_dims) -> None:
        role, tp = self._role(), parallel_dims.tp
        split = self.out_features if role == "column" else self.in_features
        if role != "whole" and tp > 1 and (split % (TP_BLOCK_SIZE * tp) or
                                             math.gcd(split // TP_BLOCK_SIZE, MAX_LEAVES) % tp):
            raise ConfigError(f"{_OWNER}: a {role}-parallel linear ({self.in_features} -> {self.out_features}) "
                              f"cannot split its {split} {'outputs' if role == 'column' else 'inputs'} over "
                              f"{tp} TP ranks as whole subtrees of its fixed tree (blocks of {TP_BLOCK_SIZE}, "
                              f"at most {MAX_LEAVES} leaves): use a TP degree that divides "
                              f"{math.gcd(split // TP_BLOCK_SIZE, MAX_LEAVES)}")
        if role == "row" and self._sharding_config.out_src_shardings is not None:
            partial = self._sharding_config.out_src_shardings
            whole = SpmdLayout({**partial.axis_types, MeshAxisName.TP: spmd.R}, partition_spec=partial.partition_spec)
            self._sharding_config = dataclasses.replace(self._sharding_config, out_src_shardings=whole)
        super().parallelize(parallel_dims)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        role = self._role()
        weight, x, mesh, group = self.weight, input, None, None
        if isinstance(weight, DTensor):
            mesh, group = weight.device_mesh, _tp_group(weight.device_mesh)
            weight = weight.to_local()
        if isinstance(x, DTensor):
            mesh, x = x.device_mesh, x.to_local()  # the gradient: as the input's placements say
        dtype = x.dtype
        x, weight = x.float(), weight.float()  # bf16 parameters: fp32 products, rounded once
        if role == "row":
            out, placement = row_parallel_linear(x, weight, group).to(dtype), Replicate()
        else:
            out = column_parallel_linear(x, weight, group if role == "column" else None).to(dtype)
            if role == "column" and self.gather_output:
                return gather_columns(out, group)
            placement = Shard(out.dim() - 1) if role == "column" else Replicate()
        return out if mesh is None else DTensor.from_local(out, mesh, [placement], run_check=False)


class InvariantRMSNorm(RMSNorm):
    """torchtitan's `RMSNorm` whose weight gradient is `scale_columns`'s invariant sum over the
    tokens, the TP ranks' tokens included under sequence parallelism: the same at any split."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, x, mesh, group = self.weight, input, None, None
        if isinstance(x, DTensor):
            mesh, placements = x.device_mesh, x.placements
            if any(isinstance(p, Shard) for p in placements):  # sequence parallel: tokens split
                group = _tp_group(mesh)
            x = x.to_local()
        if isinstance(weight, DTensor):
            weight = weight.to_local()
        # rms_norm's backward reaches its input by two paths: a view first adds them together, so
        # the input's gradient is one term at every layout (under TP, to_local's node does the same),
        # never the residual's gradient plus one, then the other
        normed = torch.nn.functional.rms_norm(x.float().view_as(x), self.normalized_shape, None, self.eps)
        out = (normed if weight is None else scale_columns(normed, weight.float(), group)).to(x.dtype)
        return out if mesh is None else DTensor.from_local(out, mesh, placements, run_check=False)


def _invariant_layers(model) -> None:
    """The model config's linears and RMSNorms as their TP-invariant counterparts, in place."""
    for kind, target in ((Linear.Config, InvariantLinear.Config), (RMSNorm.Config, InvariantRMSNorm.Config)):
        for fqn, cfg, parent, attr in list(model.traverse(kind)):
            if type(cfg) is target:
                continue
            if type(cfg) is not kind or parent is None or getattr(cfg, "bias", False):
                what = "a Linear with a bias" if type(cfg) is kind and parent is not None else \
                    f"a {type(cfg).__qualname__}"
                raise ConfigError(f"{_OWNER}: {fqn} is {what}, which the TP-invariant layers do not cover; build "
                                  "it from torchtitan's Linear (no bias) or RMSNorm, or keep torchtitan's layers "
                                  "with invariant(config, tensor_parallel=False) (data-parallel invariance only)")
            values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
            if target is InvariantLinear.Config:
                values["gather_output"] = fqn == "lm_head"
            new = target(**values)
            if isinstance(attr, int):
                parent[attr] = new
            else:
                setattr(parent, attr, new)


def refusals(config: Trainer.Config) -> list[str]:
    """What in ``config`` the invariant trainer does not cover, one reason each (empty: none)."""
    p, t = config.parallelism, config.training
    reasons = []
    for degree, what in ((p.pipeline_parallel_degree, "pipeline parallelism (parallelism.pipeline_parallel_degree)"),
                         (p.context_parallel_degree, "context parallelism (parallelism.context_parallel_degree): "
                          "ring attention adds the chunks' partial results in an order set by the ring"),
                         (p.expert_parallel_degree, "expert parallelism (parallelism.expert_parallel_degree)"),
                         ):
        if degree > 1:
            reasons.append(f"{what} is {degree}, not covered")
    shards = p.data_parallel_shard_degree
    if shards < 0:  # what the other degrees leave of the ranks, as torchtitan resolves it
        shards = int(os.environ.get("WORLD_SIZE", "1")) // max(1, p.data_parallel_replicate_degree *
                                                             p.context_parallel_degree * p.tensor_parallel_degree *
                                                             p.pipeline_parallel_degree)
    if p.data_parallel_replicate_degree > 1 and shards > 1:
        reasons.append(f"HSDP with both replicas ({p.data_parallel_replicate_degree}) and shards "
                       f"({shards}) is not covered: the "
                       "shards' sums would be added over the replicas in fp32; set "
                       "parallelism.data_parallel_shard_degree 1 (replicas) or data_parallel_replicate_degree 1 "
                       "(FSDP2)")
    if p.tensor_parallel_degree > 1:
        if p.spmd_backend != "partial_dtensor":
            reasons.append(f"tensor parallelism under parallelism.spmd_backend {p.spmd_backend!r}: the invariant TP "
                           "layers read the DTensor placements of the partial_dtensor backend; set "
                           "--parallelism.spmd_backend partial_dtensor")
        if config.compile.enable_async_tensor_parallel:
            reasons.append("async tensor parallelism (compile.enable_async_tensor_parallel) fuses the TP collectives "
                           "into torchtitan's own matmuls; turn it off")
        if config.model_spec is not None and not any(config.model_spec.model.traverse(InvariantLinear.Config)):
            reasons.append("tensor parallelism without samebits' invariant layers (invariant(config, "
                           "tensor_parallel=False) keeps torchtitan's): drop tensor_parallel=False")
        if config.model_spec is not None and getattr(config.model_spec.model, "enable_weight_tying", False):
            reasons.append("tied embedding and LM-head weights with tensor parallelism are not covered")
    if t.global_batch_size <= 0:
        reasons.append("training.global_batch_size is not set: torchtitan then makes the global batch local_batch_size "
                       "x the data-parallel degree, so each layout trains on a different batch; set "
                       "--training.global_batch_size N (a multiple of local_batch_size x every DP degree you run)")
    if config.debug.seed is None:
        reasons.append("debug.seed is not set: the initial weights are drawn from it; set --debug.seed N")
    if t.mixed_precision_reduce != "float32":
        reasons.append(f"training.mixed_precision_reduce is {t.mixed_precision_reduce}: the invariant reduction adds "
                       "float32 gradients (the parameters may compute in bfloat16); set "
                       "--training.mixed_precision_reduce float32")
    spec = config.model_spec
    if spec is not None:
        if has_quantization(spec.model):
            reasons.append("a quantized (float8/MX) model: its scaled matmuls are not covered")
        if any(spec.model.traverse(FlexAttention.Config)) and not torch.cuda.is_available():
            reasons.append("FlexAttention on a CPU (it has no CPU backward): use ScaledDotProductAttention")
    return reasons


class _UnitSum:
    """One FSDP2 unit's gradient reduction over the step's M micro-batches, in int64 fixed point
    (`reduce_blocks`, every element its own block), wherever FSDP2 lets it in:

    * FSDP2 over 2+ ranks: its custom reduce-scatter (``input_tensor`` given);
    * one rank: its post-reduce hook (FSDP2 calls no reduce-scatter there);
    * replicas (HSDP with one shard): the post-reduce hook too, which reads this rank's own
      gradient from the buffer FSDP2 took from ``allocate`` (its first of each reduction) and
      overwrites FSDP2's fp32 all-reduce of the replicas with the invariant sum over them.

    Until this rank's last micro-batch it keeps each gradient and hands back zeros (FSDP2 adds
    them: exact).  A unit of several modules (torchtitan's [norm, lm_head]) reduces in several
    calls per backward: each call of a micro-batch is kept apart by its place in that backward."""

    def __init__(self, trainer: "InvariantTrainer", replica_group=None):
        self.trainer = trainer
        self.replica_group = replica_group
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._micro_batch = -1
        self._call = 0
        self._buffers: list[torch.Tensor] = []  # replicas: this reduction's allocations, input first

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = torch.empty(size, dtype=dtype, device=device)
        if self.replica_group is not None:
            self._buffers = (self._buffers + [buffer])[-2:]
        return buffer

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor | None = None, group=None,
                 op=None, async_op: bool = False):
        """As FSDP2's ReduceScatter (``input_tensor`` given) or its post-reduce hook (``output_tensor`` only)."""
        if op is not None and op == torch.distributed.ReduceOp.AVG:
            raise ConfigError(f"{_OWNER}: FSDP2 asked for an average; the invariant reduction sums (its "
                              "gradient divide factor must stay 1.0, torchtitan's own setting)")
        source = output_tensor if input_tensor is None else input_tensor
        if input_tensor is None:  # the hook: the replicas' sum, or this rank's alone
            source, group = ((self._local_gradient(output_tensor), self.replica_group)
                             if self.replica_group is not None else (source, self.trainer._alone))
        if source.dtype != torch.float32:
            raise ConfigError(f"{_OWNER}: FSDP2 reduces {source.dtype} gradients; the invariant reduction adds "
                              "float32 ones (set --training.mixed_precision_reduce float32)")
        trainer = self.trainer
        if trainer._local_micro_batch != self._micro_batch:
            self._micro_batch, self._call = trainer._local_micro_batch, 0
        pending = self._pending.setdefault(self._call, [])
        self._call += 1
        flat = source.detach().reshape(-1, 1)
        if pending and pending[0].shape != flat.shape:
            raise ConfigError(f"{_OWNER}: an FSDP2 unit reduced {pending[0].numel()} gradient elements in one "
                              f"micro-batch and {flat.numel()} in the same place of the next (step {trainer.step}); "
                              "report this with the config")
        if trainer._local_micro_batch + 1 < trainer.gradient_accumulation_steps:
            pending.append(flat.clone())  # FSDP2's buffer outlives this call only
            output_tensor.zero_()
            return None
        pending.append(flat)
        summed = reduce_blocks(pending, num_micro_batches=trainer._num_micro_batches, group=group,
                               scatter_only=input_tensor is not None)
        pending.clear()
        output_tensor.copy_(summed.reshape(output_tensor.shape))
        return None

    def _local_gradient(self, output: torch.Tensor) -> torch.Tensor:
        """Replicas: this rank's gradient, still in the reduction's input buffer (FSDP2 copied it
        into ``output`` and all-reduced that in place)."""
        if len(self._buffers) != 2 or self._buffers[1] is not output or self._buffers[0].shape != output.shape:
            raise ConfigError(f"{_OWNER}: FSDP2's replica reduction did not allocate its buffers as expected "
                              f"(torch {torch.__version__}); HSDP replicas cannot be made invariant with this "
                              "torch: use parallelism.data_parallel_shard_degree (FSDP2) instead")
        return self._buffers[0]


class InvariantTrainer(Trainer):
    """torchtitan's `Trainer`, whose step has the same bits at any layout it covers (module docstring)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config):
        reasons = refusals(config)
        if reasons:
            raise ConfigError(f"{_OWNER}: this config cannot train with the same bits at any layout:\n  - " +
                              "\n  - ".join(reasons) + "\nRemove the samebits config to train it as it is.")
        super().__init__(config)
        self._max_norm = config.training.max_norm
        config.training.max_norm = math.inf  # torchtitan's own clip: a factor of exactly 1.0
        dims = self.parallel_dims
        batch = dims.get_mesh("batch") if dims.dp_enabled else None
        self._dp_degree = 1 if batch is None else batch.size()
        self._dp_rank = 0 if batch is None else batch.get_local_rank()
        # the clipping norm's group: every rank, each element counted once (`_counts_here`)
        self._norm_group = torch.distributed.group.WORLD if dims.world_size > 1 else None
        self._tp_rank = dims.get_mesh("tp").get_local_rank() if dims.tp_enabled else 0
        self._replica_rank = dims.get_mesh("dp_replicate").get_local_rank() if dims.dp_replicate > 1 else 0
        self._replica_group = dims.get_mesh("dp_replicate").get_group() if dims.dp_replicate > 1 else None
        # a group of this rank alone (torch.distributed's None is every rank): one-rank reductions
        lone = dims.world_size > 1 and dims.dp_shard == 1 and dims.dp_replicate == 1
        self._alone = torch.distributed.new_subgroups(1)[0] if lone else None
        self._num_micro_batches = self.gradient_accumulation_steps * self._dp_degree
        self._local_micro_batch = -1  # this rank's micro-batch of the step now in backward
        self._seen_step = -1
        self._whole_initial_weights()
        self._global_dataloader()
        self._invariant_reductions()
        self.optimizers.register_step_pre_hook(self._clip)

    # --- the initial weights: whole, from the seed, the same at any layout ------------------
    def _whole_initial_weights(self) -> None:
        with torch.device("meta"), set_default_dtype(TORCH_DTYPE_MAP[self.config.training.dtype]):
            whole = self.model_config.build()
        whole.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # the CPU generator alone, restored after
            torch.default_generator.manual_seed(self.config.debug.seed)
            whole.init_weights(buffer_device=None)
        source = dict(whole.named_parameters())
        with torch.no_grad():
            for part in self.model_parts:
                for name, param in part.named_parameters():
                    full = source.get(_WRAPPERS.sub("", name))
                    if full is None or tuple(full.shape) != tuple(param.shape):
                        raise ConfigError(f"{_OWNER}: parameter {name!r} has no counterpart of its shape in the "
                                          "whole model built from the same config; report this with the config")
                    if isinstance(param, DTensor):
                        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                        param.to_local().copy_(local.to_local())
                    else:
                        param.copy_(full)

    # --- the data: one global stream, each rank its share -----------------------------------
    def _global_dataloader(self) -> None:
        config = self.config
        self.dataloader = config.dataloader.build(
            dp_world_size=1, dp_rank=0, tokenizer=self.tokenizer, seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
            snapshot_every_n_steps=(config.checkpoint.interval * self._num_micro_batches
                                    if config.checkpoint.enable else None))
        states = getattr(self.checkpointer, "states", None)  # none when checkpointing is off
        if states is not None:
            states["dataloader"] = self.dataloader

    def batch_generator(self, data_iterable: Iterable) -> Iterator:
        """The global stream in groups of one micro-batch per rank: this rank's of each group."""
        iterator = iter(data_iterable)
        while True:
            start = time.perf_counter()
            try:
                group = [next(iterator) for _ in range(self._dp_degree)]
            except StopIteration as ex:
                raise DataloaderExhaustedError() from ex
            input_dict, labels = group[self._dp_rank]
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            self.metrics_processor.data_loading_times.append(time.perf_counter() - start)
            yield input_dict, labels

    def forward_backward_step(self, **kwargs: Any) -> torch.Tensor:
        """Draws keyed by (step, global micro-batch index), never by rank."""
        if self._seen_step != self.step:
            self._seen_step, self._local_micro_batch = self.step, -1
        self._local_micro_batch += 1
        index = self._local_micro_batch * self._dp_degree + self._dp_rank
        manual_seed(micro_batch_seed(self.config.debug.seed, self.step, index))
        return super().forward_backward_step(**kwargs)

    # --- the gradient reduction and the clipping norm --------------------------------------
    def _invariant_reductions(self) -> None:
        units = [m for part in self.model_parts for m in part.modules() if isinstance(m, FSDPModule)]
        if not units:
            raise ConfigError(f"{_OWNER}: the model has no FSDP2 unit (torchtitan's apply_fsdp_to_decoder "
                              "wraps every decoder at any degree): the reduction cannot be made invariant")
        for unit in units:
            unit.set_gradient_divide_factor(1.0)  # a SUM; torchtitan divides the loss by the global count
            reduction = _UnitSum(self, replica_group=self._replica_group)
            if self.parallel_dims.dp_shard > 1:
                unit.set_custom_reduce_scatter(reduction)
            else:  # no reduce-scatter to replace: the hook after it (and after the replicas' all-reduce)
                if self._replica_group is not None:
                    unit.set_custom_reduce_scatter(reduction)  # only its allocate(): the local gradient's buffer
                unit.set_all_reduce_hook(reduction)

    def _clip(self, optimizer, args, kwargs) -> None:
        """Clip by the sharded invariant norm before the optimizer steps (torchtitan's clip is 1.0)."""
        if not self._max_norm or self._max_norm <= 0:
            return
        params = [p for part in self.model_parts for p in part.parameters() if p.grad is not None]
        grads = [_local(p.grad) for p in params]
        clip_sharded_grad_norm_(grads, self._max_norm, full_numels=[p.numel() for p in params], group=self._norm_group,
                                replicated=[False] * len(params), counted=[self._counts_here(p) for p in params])

    def _counts_here(self, param: torch.Tensor) -> bool:
        """Whether this rank's part of ``param`` enters the norm: every element once, from the
        first rank of each axis that holds copies of it (the replicas; TP for a norm's weight)."""
        if self._replica_rank:
            return False
        if not self._tp_rank or not isinstance(param, DTensor):
            return True
        names = param.device_mesh.mesh_dim_names or ()
        return "tp" not in names or not isinstance(param.placements[names.index("tp")], Replicate)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


__all__ = ["invariant", "set_layout", "refusals", "InvariantTrainer"]
