"""Training precisions of the reference recipe: bf16, FP8 (tensorwise, delayed), MXFP8, NVFP4.

`apply_precision` converts the model before it is parallelised (as torchtitan converts before
it shards) and returns a `Precision`: the forward's autocast context, the module state a
bitwise resume must restore (FP8 delayed scaling's amax histories) and the GEMM path that ran.
Attention, dense MLP and MTP linears go low-precision; the router, output layer and experts
stay in the parameters' dtype.  docs/recipe.md ("Precision") has the rest.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import typing
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard

from samebits.errors import ConfigError

PrecisionName = Literal["fp32", "bf16", "bf16_params", "fp8_tensorwise", "fp8_delayed", "mxfp8", "nvfp4"]
PRECISIONS = typing.get_args(PrecisionName)
GEMM_PATHS = ("native", "scaled_mm", "emulated")
NEEDS_TORCHAO = ("fp8_tensorwise", "mxfp8", "nvfp4")
TORCHAO_PIN = "torchao==0.18.0"

MX_BLOCK = 32  # OCP MX v1.0: 32 elements share one e8m0 scale
NVFP4_BLOCK = 16  # NVFP4: 16 e2m1 elements share one e4m3 scale
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
E5M2_MAX = 57344.0  # torch.finfo(torch.float8_e5m2).max
HISTORY_ROLES = ("input", "weight", "grad_output")


# --- choosing the path --------------------------------------------------------------------

def resolve_gemm(precision: str, device: str, chosen: str | None = None) -> str:
    """The GEMM path ``precision`` runs on ``device``: ``chosen`` if a low precision may choose it,
    else the best one here (fp32 and bf16: "native"; a low precision given "native" resolves again)."""
    if precision in ("fp32", "bf16", "bf16_params"):
        return "native"
    if chosen not in (None, "native"):
        return chosen
    if precision in ("fp8_tensorwise", "fp8_delayed"):
        return "scaled_mm" if scaled_mm_runs(device) else "emulated"
    return "emulated"


def check_gemm(precision: str, gemm: str, device: str) -> str | None:
    """Why ``gemm`` cannot run ``precision`` here (a sentence with the fix), or None."""
    if precision not in PRECISIONS:
        return f"precision={precision!r} is not one of {', '.join(PRECISIONS)}"
    if gemm not in GEMM_PATHS:
        return f"precision_gemm={gemm!r} is not one of {', '.join(GEMM_PATHS)}"
    native = precision in ("fp32", "bf16", "bf16_params")
    if native != (gemm == "native"):
        allowed = "native" if native else "scaled_mm or emulated" if precision.startswith("fp8") else "emulated"
        return f"precision_gemm={gemm!r} does not apply to precision={precision!r}; use {allowed}"
    if precision in ("mxfp8", "nvfp4") and gemm != "emulated":
        return f"precision={precision!r} has no real GEMM here; use precision_gemm='emulated'"
    if gemm == "scaled_mm" and not scaled_mm_runs(device):
        return (f"precision_gemm='scaled_mm': torch._scaled_mm does not run fp8 on device={device!r} "
                "in this torch; use precision_gemm='emulated'")
    if precision in NEEDS_TORCHAO and not torchao_available():
        return (f"precision={precision!r} needs torchao, which is not installed: "
                f"pip install {TORCHAO_PIN}")
    return None


@functools.lru_cache(maxsize=None)
def scaled_mm_runs(device: str) -> bool:
    """Whether `torch._scaled_mm` multiplies fp8 matrices on this device (tried once)."""
    if device == "cuda" and not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
        return bool((out == 16).all())
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def torchao_available() -> bool:
    try:
        _torchao()
    except ImportError:
        return False
    return True


def _torchao():
    """Import torchao quietly (it logs a warning per CUDA extension it cannot load on CPU)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    pytree = logging.getLogger("torch.utils._pytree")  # torchao registers enums it warns about
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        import torchao.float8  # noqa: F401
        import torchao.prototype.mx_formats.mx_tensor  # noqa: F401
        import torchao.prototype.mx_formats.nvfp4_tensor  # noqa: F401
    finally:
        pytree.setLevel(level)
    return torchao


# --- what the loop uses ---------------------------------------------------------------------

@dataclass
class Precision:
    """A converted model's precision: what ran, its autocast, its resumable state."""

    name: str
    gemm: str
    model: nn.Module  # the converted model (a pipeline stage prunes it in place)
    converted: list[str] = field(default_factory=list)  # names of the low-precision linears
    autocast_dtype: torch.dtype | None = None

    @property
    def history_modules(self) -> dict[str, "_DelayedScalingLinear"]:
        """The delayed-scaling linears this rank still holds, by name."""
        return {name: m for name, m in self.model.named_modules() if isinstance(m, _DelayedScalingLinear)}

    def autocast(self, device_type: str):
        """The forward's autocast context (a no-op but for bf16)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast_dtype)

    def state_records(self) -> list[tuple[str, torch.Tensor]]:
        """Module state outside parameters and optimizer that decides the next step's bits,
        for the state census: ``fp8.<linear>.amax_history_<role>`` per delayed-scaling linear."""
        return [(f"fp8.{name}.amax_history_{role}", module.amax_history[index])
                for name, module in self.history_modules.items() for index, role in enumerate(HISTORY_ROLES)]

    @property
    def rank_local_names(self) -> frozenset[str]:
        """State-dict keys of the amax histories: an input's and a gradient's amax are this
        rank's own (its micro-batch), so the checkpoint keeps one history per rank."""
        return frozenset(f"{name}._extra_state" for name, module in self.history_modules.items()
                         if isinstance(module, DelayedFloat8Linear))


def apply_precision(model: nn.Module, precision: str, gemm: str, *, device: str = "cpu",
                    history_len: int = 16, save_history: bool = True,
                    skip: Callable[[str], bool] | None = None) -> Precision:
    """Convert ``model`` in place to ``precision``; call after init, before parallelising."""
    problem = check_gemm(precision, gemm, device)
    if problem:
        raise ConfigError(problem)
    result = Precision(precision, gemm, model)
    if precision == "bf16":
        result.autocast_dtype = torch.bfloat16
        return result
    if precision == "bf16_params":
        model.to(torch.bfloat16)
        for module in model.modules():
            if hasattr(module, "router") and hasattr(module, "experts"):  # an MoE layer: its router
                # probabilities are fp32 by design (model.py; not imported: model imports config)
                module.register_forward_hook(_output_in_param_dtype)
        return result
    if precision == "fp32":
        return result
    skip = skip or default_skip
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is nn.Linear and not skip(name)]
    if precision == "fp8_tensorwise":
        float8 = _torchao().float8
        names = {name for name, _ in targets}
        config = float8.Float8LinearConfig.from_recipe_name("tensorwise")
        config = float8.Float8LinearConfig(**{**config.__dict__, "emulate": gemm == "emulated"})
        float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in names)
        result.converted = sorted(names)
        return result
    for name, module in targets:
        if precision == "fp8_delayed":
            kind = DelayedFloat8Linear if save_history else _DelayedScalingLinear
            options = {"history_len": history_len, "emulate": gemm == "emulated"}
        else:
            kind, options = BlockScaledLinear, {"precision": precision}
        # The new linear shares the old one's parameters: the initial weights are unchanged.
        new = kind(module.in_features, module.out_features, bias=module.bias is not None,
                   device=module.weight.device, dtype=module.weight.dtype, **options)
        new.weight, new.bias = module.weight, module.bias
        _replace(model, name, new)
        result.converted.append(name)
    return result


def _output_in_param_dtype(module: nn.Module, _inputs, output):
    """Cast an MoE layer's output (fp32 router weights) back to its parameters' dtype."""
    dtype = module.router.weight.dtype
    return (output[0].to(dtype), *output[1:])


def default_skip(name: str) -> bool:
    """The linears that stay in high precision: the MoE router and the output layer."""
    return name.endswith("router") or name == "output"


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


# --- FP8 delayed scaling ------------------------------------------------------------------

class _DelayedScalingLinear(nn.Linear):
    """`nn.Linear` whose three GEMMs take fp8 operands scaled from amax histories.

    Forward: y = x W^T with x, W in e4m3.  Backward: grad_x = g W, grad_W = g^T x with g
    (the output gradient) in e5m2 and x, W as cast in the forward.  Each cast uses the scale
    of its role's history *before* this call's amax is written, so the scales of step s come
    from steps < s: state a resume must carry.  ``amax_history`` (roles x length, fp32) is a
    plain attribute, not a buffer: tensor parallelism turns every buffer of a module it
    shards into a DTensor, and these histories are this rank's own.  This class leaves them
    out of `state_dict` (the planted fault); `DelayedFloat8Linear` checkpoints them.
    """

    def __init__(self, in_features: int, out_features: int, *, history_len: int, emulate: bool,
                 bias: bool = False, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.emulate = emulate
        self.amax_history = torch.zeros(len(HISTORY_ROLES), history_len, dtype=torch.float32)

    def history(self, role: str, device: torch.device) -> torch.Tensor:
        """The live history of ``role`` (a view, updated in place), on ``device``."""
        if self.amax_history.device != device:  # follows the activations (model.to(device))
            self.amax_history = self.amax_history.to(device)
        return self.amax_history[HISTORY_ROLES.index(role)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, lambda x2d, weight: _DelayedFloat8MM.apply(x2d, weight, self))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", fp8 delayed, history={self.amax_history.shape[1]}, " \
            f"{'emulated' if self.emulate else 'scaled_mm'}"


class DelayedFloat8Linear(_DelayedScalingLinear):
    """Delayed-scaling fp8 linear whose amax histories are in `state_dict` (key
    ``<linear>._extra_state``, a (3, length) fp32 tensor), hence in the checkpoint."""

    def get_extra_state(self) -> torch.Tensor:
        return self.amax_history

    def set_extra_state(self, state: torch.Tensor) -> None:
        if tuple(state.shape) != tuple(self.amax_history.shape):
            raise ConfigError(f"fp8 amax history of shape {tuple(state.shape)} in the checkpoint, this run keeps "
                              f"{tuple(self.amax_history.shape)}: fp8_amax_history_len differs; resume with the "
                              "saved run's value")
        self.amax_history = state.detach().to(self.amax_history.device, torch.float32).clone()


def _linear(module: nn.Linear, x: torch.Tensor, matmul) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` through ``matmul(x2d, weight) -> (N, out)``, on plain tensors.

    Under tensor parallelism (DTensor weight: Shard(0) column-parallel, Shard(1) row-parallel)
    the GEMM runs on this rank's shards (their own scales: repeatable, another rounding than
    one device's) and its result goes back as a DTensor (Shard(-1), or Partial for the
    row-parallel sum).  The column-parallel input's gradient is only a partial sum, so
    ``to_local`` says so (``grad_placements=[Partial()]``) and the plan's input conversion
    all-reduces it in the backward (Megatron's "f"; without it the replicated parameters
    upstream drift apart across TP ranks: docs/recipe.md, "Precision")."""
    weight, placement = module.weight, None
    if isinstance(weight, DTensor):
        (shard,) = weight.placements  # a 1-D TP mesh
        column = shard == Shard(0)
        placement = Shard(x.dim() - 1) if column else Partial()
        mesh, weight = weight.device_mesh, weight.to_local()
        if isinstance(x, DTensor):  # column: Replicate (grad Partial); row: Shard(-1) (grad the same)
            x = x.to_local(grad_placements=[Partial()] if column else None)
    out = matmul(x.reshape(-1, x.shape[-1]), weight)
    out = out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)
    if placement is not None:
        out = DTensor.from_local(out, mesh, [placement], run_check=False)
    return out + module.bias if module.bias is not None else out


def _delayed_cast(t: torch.Tensor, history: torch.Tensor, dtype: torch.dtype,
                  max_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast ``t`` to fp8 with the history's scale, then record this amax: (fp8, 1/scale)."""
    amax = t.detach().abs().amax().float()
    past = history.max()
    reference = torch.where(past > 0, past, amax)  # an empty history: this call's own amax
    scale = torch.where(reference > 0, max_value / reference, torch.ones_like(reference))
    data = (t.float() * scale).clamp(-max_value, max_value).to(dtype)  # saturating cast
    with torch.no_grad():
        history.copy_(torch.roll(history, 1))
        history[0] = amax
    return data, scale.reciprocal()


def fp8_mm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor,
           emulate: bool) -> torch.Tensor:
    """(a * a_inv) @ (b * b_inv) for fp8 ``a`` (M, K), ``b`` (K, N), in fp32."""
    if emulate:
        return (a.float() * a_inv) @ (b.float() * b_inv)
    # torch._scaled_mm wants a row-major and b column-major.
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_inv, scale_b=b_inv,
                            out_dtype=torch.float32)


class _DelayedFloat8MM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, module):
        x8, x_inv = _delayed_cast(x, module.history("input", x.device), torch.float8_e4m3fn, E4M3_MAX)
        w8, w_inv = _delayed_cast(weight, module.history("weight", x.device), torch.float8_e4m3fn, E4M3_MAX)
        ctx.save_for_backward(x8, x_inv, w8, w_inv)
        ctx.module, ctx.dtypes = module, (x.dtype, weight.dtype)
        return fp8_mm(x8, x_inv, w8.t(), w_inv, module.emulate)  # (N, out)

    @staticmethod
    def backward(ctx, grad):
        x8, x_inv, w8, w_inv = ctx.saved_tensors
        module = ctx.module
        g8, g_inv = _delayed_cast(grad.contiguous(), module.history("grad_output", grad.device), torch.float8_e5m2,
                                  E5M2_MAX)
        grad_x = fp8_mm(g8, g_inv, w8, w_inv, module.emulate)  # (N, out) @ (out, in)
        grad_w = fp8_mm(g8.t(), g_inv, x8, x_inv, module.emulate)  # (out, N) @ (N, in)
        return grad_x.to(ctx.dtypes[0]), grad_w.to(ctx.dtypes[1]), None


# --- MXFP8 and NVFP4 (emulated) -----------------------------------------------------------

def mxfp8_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantisation of the last dim (a multiple of 32): (e8m0 scales, e4m3 elements)."""
    mx = _torchao().prototype.mx_formats.mx_tensor
    return mx.to_mx(t.float().contiguous(), torch.float8_e4m3fn, MX_BLOCK)


def mxfp8_dequantize(scales: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    mx = _torchao().prototype.mx_formats.mx_tensor
    return mx.to_dtype(data, scales, torch.float8_e4m3fn, MX_BLOCK, torch.float32)


def nvfp4_quantize(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 quantisation of the last dim (a multiple of 16) of a 2-D tensor, two-level:
    (fp32 tensor scale, e4m3 block scales, e2m1 codes packed two per byte, low nibble first)."""
    nv = _torchao().prototype.mx_formats.nvfp4_tensor
    t = t.float().contiguous()
    tensor_scale = nv.per_tensor_amax_to_scale(t.abs().amax())
    if not tensor_scale > 0:
        tensor_scale = torch.ones((), dtype=torch.float32)  # an all-zero tensor
    scales, packed = nv.nvfp4_quantize(t, NVFP4_BLOCK, per_tensor_scale=tensor_scale)
    return tensor_scale, scales, packed


def nvfp4_dequantize(tensor_scale: torch.Tensor, scales: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    nv = _torchao().prototype.mx_formats.nvfp4_tensor
    values = nv.f4_unpacked_to_f32(nv.unpack_uint4(packed))  # (M, K)
    rows = values.shape[0]
    blocks = values.view(rows, -1, NVFP4_BLOCK) * (scales.float() * tensor_scale).view(rows, -1, 1)
    return blocks.view(rows, -1)


def quantize_dequantize(t: torch.Tensor, precision: str) -> torch.Tensor:
    """``t`` (2-D) rounded to ``precision`` in blocks along its last dim, back in fp32.  The
    last dim is zero-padded to a whole block and cut back: zeros change no block's amax
    and add nothing to a dot product, so padding is exact."""
    block = MX_BLOCK if precision == "mxfp8" else NVFP4_BLOCK
    cols = t.shape[-1]
    padded = F.pad(t.float(), (0, -cols % block)).contiguous()
    if precision == "mxfp8":
        out = mxfp8_dequantize(*mxfp8_quantize(padded))
    else:
        out = nvfp4_dequantize(*nvfp4_quantize(padded))
    return out[..., :cols]


class BlockScaledLinear(nn.Linear):
    """`nn.Linear` whose three GEMMs (y = x W^T, grad_x = g W, grad_W = g^T x) take operands
    block-quantised along their contraction dim (MXFP8 or NVFP4), emulated in fp32."""

    def __init__(self, in_features: int, out_features: int, *, precision: str, bias: bool = False,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(self, x, lambda x2d, weight: _BlockScaledMM.apply(x2d, weight, self.precision))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {self.precision} emulated"


class _BlockScaledMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, precision):
        ctx.save_for_backward(x, weight)
        ctx.precision = precision
        return quantize_dequantize(x, precision) @ quantize_dequantize(weight, precision).t()

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        q = functools.partial(quantize_dequantize, precision=ctx.precision)
        grad = grad.float()
        grad_x = q(grad) @ q(weight.t()).t()  # contraction over out_features
        grad_w = q(grad.t()) @ q(x.t()).t()  # contraction over tokens
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


__all__ = ["PrecisionName", "PRECISIONS", "GEMM_PATHS", "Precision", "apply_precision", "resolve_gemm", "check_gemm",
           "mxfp8_quantize", "mxfp8_dequantize", "nvfp4_quantize", "nvfp4_dequantize",
           "quantize_dequantize", "DelayedFloat8Linear", "BlockScaledLinear"]
