"""The reductions of the recipe's step, each with the method that keeps its bits, and the check.

`RECIPE_REDUCTIONS` is the one list (docs/invariance.md's table "The reductions of the
recipe's step" is checked against it, row by row).  `unlisted_reductions(cfg)` runs one real
training step of the recipe on this process (one rank, `grad_reduce=invariant` and
`tp_reduce=invariant`) under a dispatch mode, collects every floating-point reduction with the
place it runs at (the module path, in backward the module whose forward made the autograd
node; outside every module the recipe or samebits function on the stack) and returns those no
entry covers.  `check_reductions(cfg)` raises naming each.

What counts as a reduction: an ATen op that adds, multiplies or averages over a dimension
(`REDUCTION_OPS`: sums, means, norms, matrix products, softmax, losses, SDPA, scatter-adds,
the embedding's backward) and every collective.  Elementwise ops and exact ones (max, topk,
sort, integer sums: integer addition is associative) need no entry: no grouping changes them.
"""

from __future__ import annotations

import fnmatch
import os
import sys
from dataclasses import dataclass, replace

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from samebits.errors import SamebitsError
from samebits.recipes import loop
from samebits.recipes.config import RecipeConfig


@dataclass(frozen=True)
class RecipeReduction:
    """One row of the list: what is reduced, where, what layout changes its grouping, the
    method that keeps its bits and its status (the doc table's five columns), and the places
    (module-path globs, `fnmatch`) and ATen ops (`aten.sum`, ...) of the step it covers."""

    reduction: str
    where: str
    changes_with: str
    method: str
    status: str
    places: tuple[str, ...] = ()
    ops: tuple[str, ...] = ()

    def covers(self, place: str, op: str) -> bool:
        packet = op.rsplit(".", 1)[0] if op.count(".") >= 2 else op
        return (op in self.ops or packet in self.ops) and any(fnmatch.fnmatchcase(place, p) for p in self.places)

    def row(self) -> str:
        """The doc table's row (markdown)."""
        return f"| {self.reduction} | {self.where} | {self.changes_with} | {self.method} | {self.status} |"


NOT_SPLIT = "not split by any layout"
_LINEAR_OPS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.sum")  # gemm_matmul, tree_matmul; exact: fp64 block products
_TP_LINEARS = ("layers.*.attn.qkv", "layers.*.attn.out", "layers.*.ffn.up", "layers.*.ffn.down",
               "mtp.*.block.attn.qkv", "mtp.*.block.attn.out", "mtp.*.block.ffn.up", "mtp.*.block.ffn.down")
_BLOCK_NORMS = ("layers.*.attn_norm", "layers.*.ffn_norm", "mtp.*.block.attn_norm", "mtp.*.block.ffn_norm")
_NORM_OPS = ("aten.mean", "aten.sum", "aten._fused_rms_norm", "aten._fused_rms_norm_backward")
_SDPA = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
         *(f"_scaled_dot_product_{kernel}_attention{suffix}" for kernel in ("efficient", "flash", "cudnn")
           for suffix in ("", "_backward")))  # SDPA's ATen kernels, forward and backward
_COLLECTIVES = ("c10d.allreduce_", "c10d.reduce_scatter_", "c10d._reduce_scatter_base_",
                "c10d.allgather_", "c10d._allgather_base_", "c10d.alltoall_", "c10d.alltoall_base_")

RECIPE_REDUCTIONS: tuple[RecipeReduction, ...] = (
    RecipeReduction(
        "attention output and MLP down projections (K = d_model, ffn_hidden_size)", "row-parallel forward",
        "tp (K split)", "`tree_matmul`: leaves in one fixed tree, fp32 all-gather of the partials (`exact`: exact "
        "block products, int64 all-reduce)", "done",
        _TP_LINEARS, _LINEAR_OPS),
    RecipeReduction(
        "QKV and MLP up projections (K = d_model)", "column-parallel forward",
        "tp (local N: kernel choice)", "`gemm_matmul` (bits of an element from its row and column only)", "done",
        _TP_LINEARS, _LINEAR_OPS),
    RecipeReduction(
        "input gradient of QKV and MLP up (over N)", "column-parallel backward", "tp (N split)",
        "`tree_matmul`", "done", _TP_LINEARS, _LINEAR_OPS),
    RecipeReduction(
        "input gradient of attention output and MLP down (over N)", "row-parallel backward",
        "tp (local K: kernel choice)", "`gemm_matmul`", "done", _TP_LINEARS, _LINEAR_OPS),
    RecipeReduction(
        "weight gradients of the TP linears (over tokens)", "backward", "tp (local shapes); DP (tokens split)",
        "`gemm_matmul`; DP: `grad_reduce=invariant`", "done for TP; DP separately",
        _TP_LINEARS, _LINEAR_OPS),
    RecipeReduction(
        "attention scores and values (over head_dim, keys)", "SDPA per head", "tp (heads per rank)",
        "none needed: per-head computation, measured identical (block outputs at tp2 = tp1)",
        "done (measured, not by construction)", ("layers.*.attn", "mtp.*.block.attn"),
        tuple(f"aten.{name}" for name in _SDPA)),
    RecipeReduction(
        "RMSNorm statistics (over d_model)", "every norm", "none (each position whole, with SP too; measured)",
        NOT_SPLIT, "done", (*_BLOCK_NORMS, "norm", "mtp.*.hidden_norm", "mtp.*.embed_norm"), _NORM_OPS),
    RecipeReduction(
        "norm weight gradients of the blocks (over tokens)", "backward",
        "SP (tokens sharded: fp32 all-reduce of partials)",
        "`scale_columns` / `invariant_sum`: int64 fixed point over positions and TP ranks", "done",
        _BLOCK_NORMS, ("aten.sum", *_COLLECTIVES)),
    RecipeReduction(
        "the embedding output's gradient (blocks' part + MTP's part)", "backward, autograd accumulation",
        "SP (the graph around the first block)",
        "one autograd node where the stream enters the blocks, at every layout", "done"),
    RecipeReduction(
        "router softmax, top-k renormalisation, load-balancing sum (over experts, over k)", "MoE layers",
        "none (each token whole; the MoE layer routes the whole sequence under SP)",
        NOT_SPLIT, "done", ("layers.*.ffn", "layers.*.ffn.router"),
        ("aten._softmax", "aten._softmax_backward_data", "aten.sum", "aten.mm")),
    RecipeReduction(
        "router, experts, combine (`index_add`)", "MoE layers",
        "EP (tokens of every DP rank in one expert GEMM, all_to_all order)",
        "forward and input gradient one `gemm_matmul` per expert over every source's rows (a row's bits its "
        "own); weight gradients one GEMM per (expert, source rank) segment, one micro-batch's, summed on the "
        "owner in int64 (`InvariantExpertGradients`, one native pass each); the combine is one rank's already",
        "done (ep2 = one rank: tested; ep4 by hand)", ("layers.*.ffn", "layers.*.ffn.router", "layers.*.ffn.experts"),
        ("aten.mm", "aten.index_add", "aten.index_add_", "aten.sum", *_COLLECTIVES)),
    RecipeReduction(
        "output layer, final and MTP norms, embedding gradient, MTP projection",
        "head (whole sequence, replicated under TP)", "DP (tokens split); plain SP without MTP (vocab split)",
        "invariant SP keeps the head whole; DP: `grad_reduce=invariant`", "done for TP",
        ("output", "embed", "mtp.*.proj"), ("aten.mm", "aten.sum", "aten.embedding_dense_backward")),
    RecipeReduction(
        "cross-entropy, load-balancing and MTP losses (mean over tokens)", "loss (replicated)",
        "DP (per-rank means)", "DP: global token count (`grad_reduce=invariant`)", "done for TP",
        ("recipes.loop._losses", "layers.*.ffn"),
        ("aten._log_softmax", "aten._log_softmax_backward_data", "aten.nll_loss_forward",
         "aten.nll_loss_backward", "aten.mean")),
    RecipeReduction(
        "the step's losses over micro-batches (metrics)", "step", "none (a (micro-batch, loss) table, one row "
        "per micro-batch, filled by an exact all-reduce of zeros and one row)", NOT_SPLIT, "done",
        ("recipes.loop._Run._invariant_step",), ("aten.sum", *_COLLECTIVES)),
    RecipeReduction(
        "DP gradient reduction", "step", "DP size",
        "`grad_reduce=invariant`: int64 fixed point, each element its own block, over the DP group",
        "done, at any tp with `tp_reduce=invariant` (tp2-dp2 = one rank: tested)",
        ("invariant.*GradientAccumulator.*",), _COLLECTIVES),
    RecipeReduction(
        "FSDP2 reduce-scatter", "step", "dp_shard",
        "`InvariantReduceScatter` through FSDP2's `set_custom_reduce_scatter`",
        "done (fsdp2 = one rank, with and without `tp_reduce=invariant`, and fsdp2-tp2 with both: tested)",
        ("invariant.*InvariantReduceScatter.*",), _COLLECTIVES),
    RecipeReduction(
        "the embedding output's gradient under FSDP2", "backward, autograd accumulation",
        "dp_shard (FSDP2's node on the blocks' input)",
        "one autograd node where the stream enters the blocks, at every layout", "done"),
    RecipeReduction(
        "gradient-norm sums of squares", "clipping", "tp (shard groups), dp_shard, DP, pp (stage totals)",
        "`sharded_grad_norm` over the group the gradients are split over (TP's, FSDP2's, both: the world with "
        "TP replicas counted once, the pipeline's with every tensor listed; whole on DP ranks)",
        "done for tp, dp_shard, both, DP, pp (not pp with tp)",
        ("invariant.*sharded_grad_norm", "invariant.*canonical_grad_norm"),
        ("aten.sum", "aten.cumsum", *_COLLECTIVES)),
    RecipeReduction(
        "pipeline micro-batch gradient accumulation", "PP schedule", "pp, pp_microbatches",
        "the accumulator's micro-batches are the pipeline's; its int64 sum per stage",
        "done (pp2 and pp2-dp2 = one rank; tested: pp2)"),
    RecipeReduction(
        "dropout and router jitter draws", "every block", "pp (a stage starts the stream afresh)",
        "a stream per (seed, step, micro-batch, block), `BlockKeys`", "done under `grad_reduce=invariant`"),
    RecipeReduction(
        "AdamW update", "step", "none (elementwise on each shard)", "-", "done (measured: identical)"),
)

# ATen ops (overload packets) that add, multiply or average over a dimension.  Exact ones
# (max, min, argmax, topk, sort, bincount) are left out: their result has no grouping.
REDUCTION_OPS = frozenset(f"aten.{name}" for name in (
    "sum", "nansum", "mean", "prod", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm",
    "logsumexp", "cumsum", "cumprod", "_foreach_norm",
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "mv", "addmv", "dot", "vdot", "_addmm_activation",
    "_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data",
    "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward", "nll_loss2d_backward",
    "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward",
    "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
    "embedding_dense_backward", "_embedding_bag", "_embedding_bag_backward", *_SDPA,
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward"))
_ACCUMULATING = frozenset({"aten.index_put", "aten.index_put_", "aten._index_put_impl_"})  # with accumulate=True
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")
_NOT_REDUCTIONS = frozenset({"c10d.barrier", "c10d.monitored_barrier_", "_c10d_functional.wait_tensor"})


@dataclass(frozen=True)
class ReductionSite:
    """A reduction the step ran: its place (module path or function), phase and ATen op."""

    place: str
    phase: str  # "forward" or "backward"
    op: str  # overload name, e.g. "aten.sum.dim_IntList"

    def message(self) -> str:
        return (f"unlisted reduction: {self.op} in {self.place or '<top level>'} ({self.phase}): add it to "
                "RECIPE_REDUCTIONS in samebits/recipes/reductions.py with its method (docs/invariance.md)")


def is_reduction(func, args, kwargs) -> bool:
    """Whether an ATen op call reduces floating-point values over a dimension (or is a collective)."""
    packet = str(func.overloadpacket)
    namespace = packet.partition(".")[0]
    if namespace in _COLLECTIVE_NAMESPACES:
        return packet not in _NOT_REDUCTIONS
    if packet in _ACCUMULATING:
        accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
        if not accumulate:
            return False
    elif packet not in REDUCTION_OPS:
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
    return any(t.is_floating_point() or t.is_complex() for t in tensors)  # integer sums are exact


_SRC = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/samebits
_THIS = os.path.abspath(__file__)


def _calling_function() -> str:
    """The innermost samebits function on the stack (``recipes.loop._losses``), for ops outside
    every module: the place a reduction there is listed under."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_SRC) and path != _THIS:
            module = frame.f_globals.get("__name__", "").removeprefix("samebits.")
            return f"{module}.{frame.f_code.co_qualname}"
        frame = frame.f_back
    return ""


class _ReductionTrace(TorchDispatchMode):
    """Records a `ReductionSite` for every reduction: the innermost module's path in forward
    (global module hooks), in backward the place of the forward op that made the autograd
    node (its sequence number), outside every module the calling samebits function."""

    def __init__(self, names: dict[int, str]):
        super().__init__()
        self.names, self.stack, self.sites = names, [], []
        self._by_sequence: dict[int, str] = {}
        self._handles = []

    def __enter__(self):
        self._handles = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def _pre(self, module, _args):
        if id(module) in self.names:
            self.stack.append(self.names[id(module)])

    def _post(self, module, _args, _out):
        if id(module) in self.names and self.stack:
            self.stack.pop()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        backward = torch._C._current_graph_task_id() != -1
        if backward:
            node = torch._C._current_autograd_node()
            place = None if node is None else self._by_sequence.get(node._sequence_nr())
            place = place if place is not None else _calling_function()
        else:
            place = self.stack[-1] if self.stack else _calling_function()
        if is_reduction(func, args, kwargs):
            self.sites.append(ReductionSite(place, "backward" if backward else "forward", str(func)))
        out = func(*args, **kwargs)
        if not backward:
            seq = torch._C._autograd._get_sequence_nr()
            if seq:
                self._by_sequence.setdefault(seq - 1, place)
        return out


def checked_config(cfg: RecipeConfig | None = None) -> RecipeConfig:
    """The config the check traces: ``cfg`` (default: a small model with MoE and MTP) with both
    switches on, on one rank."""
    cfg = cfg or RecipeConfig(num_layers=2, seq_len=32, micro_batch_size=2, num_micro_batches=2)
    return replace(cfg, grad_reduce="invariant", tp_reduce="invariant", ep=1, tp=1, pp=1, dp_shard=1,
                   dp_replicate=0)


def traced_reductions(cfg: RecipeConfig | None = None, *, model_hook=None) -> list[ReductionSite]:
    """Every reduction of one training step of the recipe on this process (`checked_config`),
    in the order run, duplicates dropped.  ``model_hook(model)`` may change the model first
    (tests plant a reduction)."""
    cfg = checked_config(cfg)
    with loop.session(cfg) as (rank, world_size):
        run = loop._Run(cfg, rank, world_size)
        if model_hook is not None:
            model_hook(run.model)
        names = {id(module): name for name, module in run.model.named_modules()}
        with _ReductionTrace(names) as trace:
            run.train_step(None)
    return list(dict.fromkeys(trace.sites))


def uncovered(sites: list[ReductionSite], reductions=RECIPE_REDUCTIONS) -> list[ReductionSite]:
    """The sites no entry of ``reductions`` covers (its place glob and its op)."""
    return [site for site in sites if not any(entry.covers(site.place, site.op) for entry in reductions)]


def unlisted_reductions(cfg: RecipeConfig | None = None, *, reductions=RECIPE_REDUCTIONS,
                        model_hook=None) -> list[ReductionSite]:
    """The reductions of one step (`traced_reductions`) that no entry of ``reductions`` covers."""
    return uncovered(traced_reductions(cfg, model_hook=model_hook), reductions)


def check_reductions(cfg: RecipeConfig | None = None, *, reductions=RECIPE_REDUCTIONS,
                     model_hook=None) -> list[ReductionSite]:
    """Raise `SamebitsError` naming every reduction of one step that the list does not cover
    (one line each); returns the step's reductions when every one is listed."""
    sites = traced_reductions(cfg, model_hook=model_hook)
    unlisted = uncovered(sites, reductions)
    if unlisted:
        raise SamebitsError("\n".join(site.message() for site in unlisted))
    return sites


def markdown_table() -> str:
    """docs/invariance.md's table of the reductions, rendered from `RECIPE_REDUCTIONS`."""
    head = ["| reduction | where | its grouping changes with | method | status |", "|---|---|---|---|---|"]
    return "\n".join([*head, *(entry.row() for entry in RECIPE_REDUCTIONS)])


__all__ = ["RecipeReduction", "RECIPE_REDUCTIONS", "REDUCTION_OPS", "ReductionSite", "is_reduction",
           "checked_config", "traced_reductions", "uncovered", "unlisted_reductions", "check_reductions",
           "markdown_table"]
