"""Configuration of the reference recipe: one dataclass, presets, and `--set` parsing.

A preset is a function returning a `RecipeConfig`; `--set key=value` overrides apply
on top of it.  Every field is validated in `__post_init__` (ValueError naming the field
and the fix), so a config that exists is a config that runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from dataclasses import dataclass
from typing import Any, Literal

from samebits.errors import ConfigError
from samebits.invariant import TP_BLOCK_SIZE
from samebits.recipes.precision import PrecisionName, check_gemm, resolve_gemm

# Option types: the choices of a field are its Literal's arguments (validated and parsed from
# them with typing.get_args; nowhere else lists them).
MoeCombine = Literal["index_add", "index_put_accumulate", "triton_deterministic", "triton_atomic"]
MoeGroupedGemm = Literal["torch", "triton_deterministic", "triton_atomic"]
EmbeddingBackward = Literal["dense", "index_put_accumulate"]
DataDtype = Literal["uint16", "uint32"]
Device = Literal["cpu", "cuda"]
PipelineSchedule = Literal["gpipe", "1f1b"]
GradReduce = Literal["mean", "invariant"]
TpReduce = Literal["plain", "invariant"]


@dataclass(kw_only=True)
class RecipeConfig:
    """A small Nemotron-like MoE pretraining run; the defaults run a few steps/s on 2 CPU cores."""

    # --- reproducibility -------------------------------------------------------------
    seed: int = 0
    """Seeds model init (same on every rank), data order and the per-rank training RNGs."""

    deterministic: bool = True
    """Promise bitwise run-to-run determinism: validate the config with
    `samebits.determinism.validate` and turn on `torch.use_deterministic_algorithms`."""

    device: Device = "cpu"
    """"cpu" (gloo between ranks) or "cuda" (one GPU per rank, cuda:LOCAL_RANK, NCCL)."""

    num_threads: int | None = None
    """`torch.set_num_threads` per rank (it decides how CPU reductions split).  None: the
    launcher's ``OMP_NUM_THREADS``, else 1, resolved when built so the stored config has it."""

    # --- model -----------------------------------------------------------------------
    vocab_size: int = 512
    """Number of token ids; data tokens must be below it."""

    d_model: int = 64
    """Hidden size of the residual stream."""

    num_layers: int = 4
    """Number of transformer blocks (dense and MoE together)."""

    num_heads: int = 4
    """Attention heads; must divide `d_model` into an even head size (RoPE rotates pairs)."""

    ffn_hidden_size: int = 256
    """Hidden size of the dense feed-forward layers (squared-ReLU MLP, as in Nemotron)."""

    moe_layer_freq: int = 2
    """Every `moe_layer_freq`-th block is MoE: block i is MoE when i % freq == freq - 1
    (freq 2: blocks 1, 3, ...; freq 1: all).  0 makes every block dense."""

    num_experts: int = 4
    """Experts per MoE layer (global); must be divisible by the expert-parallel size."""

    moe_top_k: int = 2
    """Experts each token is routed to."""

    moe_ffn_hidden_size: int = 128
    """Hidden size of each expert's squared-ReLU MLP."""

    moe_aux_loss_coeff: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer form) in the total loss."""

    moe_jitter_eps: float = 0.01
    """Router input jitter: multiply by U(1-eps, 1+eps) in training (0 disables).  Drawn
    from the recipe's own per-rank `router_jitter` generator."""

    moe_combine: MoeCombine = "index_add"
    """How expert outputs are summed back per token: "index_add" (deterministic),
    "index_put_accumulate" (races with >1 thread) or `samebits.kernels`' Triton kernels."""

    moe_grouped_gemm: MoeGroupedGemm = "torch"
    """Expert MLP computation: "torch" (a loop of matmuls) or the Triton grouped GEMM
    "triton_deterministic" / "triton_atomic" from `samebits.kernels`."""

    mtp_num_layers: int = 1
    """Multi-token prediction depth (DeepSeek-V3 style): module d predicts token t+1+d.
    0 disables MTP."""

    mtp_loss_coeff: float = 0.3
    """Weight of the mean MTP loss in the total loss."""

    embedding_backward: EmbeddingBackward = "dense"
    """Token embedding lookup: "dense" (`F.embedding`) or "index_put_accumulate" (`weight[tokens]`,
    whose backward races with >1 thread)."""

    dropout: float = 0.1
    """Residual dropout after attention and feed-forward; draws from torch's global CPU RNG."""

    rope_theta: float = 10000.0
    """RoPE base frequency."""

    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    init_std: float = 0.02
    """Standard deviation of the normal init of weight matrices and embeddings."""

    # --- parallelism (recipes/parallelize.py; world size = pp * dp_replicate * dp_shard * tp) --
    dp_replicate: int = 0
    """Data-parallel replicas (plain DP: one flat all-reduce of the gradients).  0 (default):
    whatever the world size leaves after dp_shard, tp and pp."""

    dp_shard: int = 1
    """Fully sharded data parallelism over this many ranks (FSDP2 `fully_shard`)."""

    tp: int = 1
    """Tensor parallelism (DTensor `parallelize_module`): attention and dense MLPs split by
    heads / hidden columns; must divide num_heads and ffn_hidden_size."""

    sequence_parallel: bool = True
    """With tp > 1, shard the residual stream along the sequence between the TP linears
    (torchtitan's SequenceParallel; seq_len divisible by tp).  False: replicated (Megatron TP)."""

    tp_reduce: TpReduce = "plain"
    """The tensor-parallel reductions: "plain" (fp32 sums over the TP ranks: the bits depend on
    tp) or "invariant" (int64 fixed point: the same bits at any tp; set it at every TP degree
    compared, tp=1 included; docs/invariance.md)."""

    pp: int = 1
    """Pipeline stages (`torch.distributed.pipelining`): the blocks split evenly in order."""

    ep: int = 0
    """Expert parallelism over the data-parallel replicas: 1 (every expert on every rank) or
    dp_replicate (tokens travel by all_to_all); 0 (default) means dp_replicate."""

    pp_microbatches: int = 2
    """Micro-batches per step and pipeline (pp > 1); must divide micro_batch_size.  Not used
    under grad_reduce="invariant" (the pipeline runs each DP rank's num_micro_batches share)."""

    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule: "gpipe" (all forwards, then all backwards) or "1f1b"."""

    # --- planted faults (for testing detection; each makes runs differ, see docs/recipe.md) --
    fault_tp_racy_accumulate: bool = False
    """Row-parallel TP linears add their local partial products in an order drawn from the
    operating system's entropy each call (a race), so two runs of a TP cell differ."""

    fault_pp_reorder_microbatch_grads: bool = False
    """The last pipeline stage accumulates its micro-batch gradients in reverse order
    (needs pp_microbatches >= 3; order does not matter for two addends)."""

    fault_ep_dispatch_order: bool = False
    """The EP dispatcher hands each local expert its received rows in an order drawn from
    the operating system's entropy, so the expert weight gradients of two runs differ."""

    # --- data ------------------------------------------------------------------------
    seq_len: int = 64
    """Tokens per sample fed to the model (each sample holds seq_len + 1 tokens)."""

    micro_batch_size: int = 4
    """Samples per rank per step; the global batch is micro_batch_size * world_size."""

    data_path: str | None = None
    """Flat binary token file (nanoGPT / Megatron style) read with np.memmap; None uses the
    seeded synthetic Markov-chain stream."""

    data_dtype: DataDtype = "uint16"
    """Element type of `data_path`: "uint16" or "uint32"."""

    # --- optimisation ----------------------------------------------------------------
    lr: float = 3e-3
    """Peak learning rate (after warm-up)."""

    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay, kept afterwards."""

    warmup_steps: int = 10
    """Linear warm-up steps (step s uses lr * (s + 1) / warmup_steps)."""

    lr_decay_steps: int = 1000
    """Cosine decay length after warm-up."""

    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices and embeddings only."""

    adam_beta1: float = 0.9
    """AdamW beta1."""

    adam_beta2: float = 0.95
    """AdamW beta2."""

    adam_eps: float = 1e-8
    """AdamW epsilon."""

    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping; the norm is still reported)."""

    grad_reduce: GradReduce = "mean"
    """Data-parallel gradient reduction: "mean" (fp32 all-reduce: the bits depend on the DP size)
    or "invariant" (`num_micro_batches` per step, draws keyed by (step, micro-batch, block), int64
    fixed-point sums: the same bits at any DP, FSDP2, PP and EP size; docs/invariance.md)."""

    num_micro_batches: int = 4
    """grad_reduce="invariant": micro-batches per step over all ranks, a multiple of every DP
    size compared; the global batch is num_micro_batches * micro_batch_size samples."""

    # --- precision (recipes/precision.py, docs/recipe.md) ----------------------------
    precision: PrecisionName = "fp32"
    """Training precision: "fp32", "bf16" (autocast), "bf16_params", "fp8_tensorwise",
    "fp8_delayed", "mxfp8" or "nvfp4" (docs/recipe.md, "Precision")."""

    precision_gemm: str | None = None
    """GEMM path of a low precision: "scaled_mm" (torch._scaled_mm) or "emulated" (fp32 GEMM of
    dequantised operands).  None: resolved when built, so records name the path that ran
    (`precision.resolve_gemm`); fp32 and bf16 run "native"."""

    fp8_amax_history_len: int = 16
    """fp8_delayed: steps of amax kept per linear and role; the scale uses their max."""

    fp8_save_amax_history: bool = True
    """fp8_delayed: checkpoint the amax histories.  False plants a fault: the histories are
    left out of the checkpoint, so a resumed run scales differently and diverges."""

    def __post_init__(self) -> None:
        def need(cond: bool, message: str) -> None:
            if not cond:
                raise ConfigError(message)

        if self.num_threads is None:
            self.num_threads = _threads_from_environment()
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "ffn_hidden_size", "num_experts",
                     "moe_top_k", "moe_ffn_hidden_size", "seq_len", "micro_batch_size", "num_threads",
                     "dp_shard", "tp", "pp", "pp_microbatches", "num_micro_batches", "fp8_amax_history_len"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("moe_layer_freq", "mtp_num_layers", "warmup_steps", "lr_decay_steps", "dp_replicate", "ep",
                     "moe_aux_loss_coeff", "moe_jitter_eps", "mtp_loss_coeff", "lr", "min_lr",
                     "weight_decay", "grad_clip", "norm_eps", "init_std", "adam_eps"):
            need(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        need(self.d_model % self.num_heads == 0 and (self.d_model // self.num_heads) % 2 == 0,
             f"num_heads={self.num_heads} must split d_model={self.d_model} into an even head size")
        need(self.moe_top_k <= self.num_experts,
             f"moe_top_k={self.moe_top_k} must be <= num_experts={self.num_experts}")
        need(self.moe_jitter_eps < 1, f"moe_jitter_eps must be < 1, got {self.moe_jitter_eps}")
        need(0 <= self.dropout < 1, f"dropout must be in [0, 1), got {self.dropout}")
        need(self.min_lr <= self.lr, f"min_lr={self.min_lr} must be <= lr={self.lr}")
        need(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
             "adam_beta1 and adam_beta2 must be in [0, 1)")
        need(self.mtp_num_layers < self.seq_len,
             f"mtp_num_layers={self.mtp_num_layers} must be < seq_len={self.seq_len}")
        for name, choices in literal_choices(type(self)).items():
            need(getattr(self, name) in choices,
                 f"{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        need(self.num_heads % self.tp == 0 and self.ffn_hidden_size % self.tp == 0,
             f"tp={self.tp} must divide num_heads={self.num_heads} and "
             f"ffn_hidden_size={self.ffn_hidden_size}")
        need(not (self.sequence_parallel and self.tp > 1) or self.seq_len % self.tp == 0,
             f"sequence_parallel with tp={self.tp} shards the sequence over the TP ranks: "
             f"seq_len={self.seq_len} must be divisible by tp; change seq_len or set "
             "sequence_parallel=false")
        need(self.pp <= self.num_layers,
             f"pp={self.pp} stages need at least as many blocks; num_layers={self.num_layers}")
        need(self.pp == 1 or self.micro_batch_size % self.pp_microbatches == 0,
             f"pp_microbatches={self.pp_microbatches} must divide "
             f"micro_batch_size={self.micro_batch_size}")
        need(self.ep in (0, 1) or self.ep == self.dp_replicate,
             f"ep={self.ep} must be 0 (= dp_replicate), 1 (no expert parallelism) or "
             f"dp_replicate={self.dp_replicate}")
        need(not self.fault_tp_racy_accumulate or self.tp > 1,
             "fault_tp_racy_accumulate plants a fault in tensor-parallel layers: set tp >= 2")
        need(not self.fault_pp_reorder_microbatch_grads
             or (self.pp > 1 and self.pp_microbatches >= 3),
             "fault_pp_reorder_microbatch_grads needs pp >= 2 and pp_microbatches >= 3")
        self._check_grad_reduce(need)
        self._check_tp_reduce(need)
        need(self.data_dtype != "uint16" or self.vocab_size <= 2**16,
             f"vocab_size={self.vocab_size} does not fit data_dtype='uint16'; use 'uint32'")
        self.precision_gemm = resolve_gemm(self.precision, self.device, self.precision_gemm)
        problem = check_gemm(self.precision, self.precision_gemm, self.device)
        need(problem is None, problem or "")

    def _check_grad_reduce(self, need) -> None:
        """grad_reduce='invariant': the layouts it covers today (docs/invariance.md)."""
        if self.grad_reduce != "invariant":
            return
        need(self.ep == 1 or (self.tp == 1 and self.moe_grouped_gemm == "torch"),
             f"grad_reduce='invariant' with ep={self.ep} covers tp=1 and moe_grouped_gemm='torch' only "
             f"(the experts' invariant GEMMs), not tp={self.tp}, moe_grouped_gemm="
             f"{self.moe_grouped_gemm!r} (docs/invariance.md). Set ep=1, or tp=1 and moe_grouped_gemm=torch.")
        need(self.pp == 1 or self.tp == 1,
             f"grad_reduce='invariant' with pp={self.pp} covers tp=1 only, not tp={self.tp} yet (the "
             "clipping norm over stages and TP shards together is not wired; docs/invariance.md). "
             "Set tp=1 or pp=1.")
        need(self.tp == 1 or self.tp_reduce == "invariant",
             f"grad_reduce='invariant' with tp={self.tp} needs tp_reduce='invariant' too: the TP "
             "linears' fp32 sums over the TP ranks depend on tp, so the data-parallel sum would add "
             "gradients whose bits already depend on the layout. Set tp_reduce=invariant, or tp=1.")

    def _check_tp_reduce(self, need) -> None:
        """tp_reduce='invariant': what its layers and norm cover today (docs/invariance.md)."""
        if self.tp_reduce != "invariant":
            return
        blockers = [f"{name}={getattr(self, name)!r}" for name, ok in (
            ("precision", self.precision == "fp32"),
            ("ep", self.ep == 1 or (self.tp == 1 and self.grad_reduce == "invariant")),
            ("pp", self.pp == 1 or self.tp == 1),
            ("dp_shard", self.dp_shard == 1 or self.tp == 1 or self.grad_reduce == "invariant"),
            ("fault_tp_racy_accumulate", not self.fault_tp_racy_accumulate)) if not ok]
        need(not blockers,
             f"tp_reduce='invariant' makes the tensor-parallel linears, the norms and the clipping "
             f"norm independent of tp but does not cover {', '.join(blockers)} yet (docs/invariance.md "
             "lists what is covered). Set precision=fp32; pp=1 when tp > 1; ep=1 unless tp=1 with "
             "grad_reduce=invariant; dp_shard=1 when tp > 1 unless grad_reduce=invariant.")
        block = TP_BLOCK_SIZE * self.tp
        need(self.d_model % block == 0 and self.ffn_hidden_size % block == 0,
             f"tp_reduce='invariant' cuts each TP rank's share of a reduction into whole blocks of "
             f"{TP_BLOCK_SIZE}: at tp={self.tp}, d_model={self.d_model} and ffn_hidden_size="
             f"{self.ffn_hidden_size} must be multiples of {block}; change the sizes or the TP degree")

    @property
    def moe_layer_ids(self) -> list[int]:
        """Indices of the MoE blocks."""
        freq = self.moe_layer_freq
        return [i for i in range(self.num_layers) if freq and i % freq == freq - 1]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict of every field (stored in streams and checkpoints)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RecipeConfig:
        """Inverse of `to_dict`; unknown keys are an error, missing keys take defaults."""
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(unknown)}; "
                             f"valid keys: {', '.join(f.name for f in dataclasses.fields(cls))}")
        return cls(**values)

    def with_overrides(self, assignments: list[str]) -> RecipeConfig:
        """Apply `key=value` strings (the CLI's `--set`), converting by field type."""
        hints = typing.get_type_hints(type(self))
        values = self.to_dict()
        for assignment in assignments:
            key, sep, text = assignment.partition("=")
            key = key.strip()
            if not sep or key not in values:
                raise ConfigError(f"--set {assignment!r}: expected key=value with key one of "
                                 f"{', '.join(values)}")
            values[key] = _parse_value(key, text.strip(), hints[key])
        return type(self).from_dict(values)


@functools.lru_cache(maxsize=None)
def literal_choices(cls: type) -> dict[str, tuple]:
    """{field: its allowed values} for every `Literal`-typed field of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


def _parse_value(key: str, text: str, hint: Any) -> Any:
    if typing.get_origin(hint) is Literal:  # validated against the choices by __post_init__
        return text
    optional = type(None) in typing.get_args(hint)
    if optional and text.lower() in ("none", "null", ""):
        return None
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    try:
        if base is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ConfigError(text)
        return base(text)
    except ValueError:
        raise ConfigError(f"--set {key}={text}: not a valid {base.__name__}") from None


def default_config() -> RecipeConfig:
    """The deterministic reference run."""
    return RecipeConfig()


def nondeterministic_config() -> RecipeConfig:
    """The same run on the nondeterministic CPU path, sized so that it shows within a step:
    `index_put_(accumulate=True)` runs multi-threaded only above ATen's grain size (32768)."""
    return RecipeConfig(deterministic=False, num_threads=2, micro_batch_size=8,
                        moe_combine="index_put_accumulate",
                        embedding_backward="index_put_accumulate")


PRESETS = {"default": default_config, "nondeterministic": nondeterministic_config}


def _threads_from_environment() -> int:
    """The thread count a default config uses: ``OMP_NUM_THREADS`` if set, else 1."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"OMP_NUM_THREADS={value!r} is not a positive integer: the recipe takes its default "
                         "thread count from it. Export a count (e.g. OMP_NUM_THREADS=1) or unset it.")
    return int(value)
