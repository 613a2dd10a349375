"""Architecture of the reference recipe: a small Nemotron-like MoE decoder (architecture only).

RMSNorm, causal RoPE attention through SDPA, squared-ReLU MLPs, dense and MoE blocks and a
DeepSeek-V3-style MTP head sharing the embedding and output layer (docs/recipe.md, "Model").
No parallelism here (torchtitan's split: `parallelize.py` applies it from outside), but what
lets it be applied: a pluggable MoE `dispatcher`, a head-major fused QKV, blocks in a
ModuleDict and a three-phase `forward` a pipeline stage can prune.  Shapes in comments: B
batch, T sequence, D d_model, N = B*T tokens, K top-k, E experts, R routed rows (N*K).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import samebits.kernels as kernels
from samebits import invariant
from samebits.errors import ConfigError
from samebits.recipes.config import RecipeConfig


@dataclass
class ModelOutput:
    logits: torch.Tensor  # (B, T, V) next-token logits
    mtp_logits: list[torch.Tensor]  # depth d (1-based): (B, T-d, V), predicts token t+1+d
    load_balancing_loss: torch.Tensor  # () mean over MoE layers (0 without MoE layers)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """Nemotron's MLP activation."""
    return F.relu(x).square()


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables (non-persistent: derived from the config, not state)."""

    def __init__(self, head_dim: int, max_len: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # (T, hd/2)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, T, hd)
        seq_len = x.shape[-2]
        cos, sin = self.cos[:seq_len], self.sin[:seq_len]  # (T, hd/2)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: RecipeConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rope = RotaryEmbedding(cfg.d_model // cfg.num_heads, cfg.seq_len, cfg.rope_theta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D)
        batch, seq_len, _ = x.shape
        # Head-major: (B, T, H, 3, hd); H is the number of heads this projection holds.
        qkv = self.qkv(x).view(batch, seq_len, -1, 3, self.head_dim)
        q, k, v = qkv.permute(3, 0, 2, 1, 4)  # each (B, H, T, hd)
        q, k = self.rope(q), self.rope(k)
        # SDPA forward and backward are deterministic on CPU at any thread count.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq_len, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(squared_relu(self.up(x)))


class LocalDispatcher:
    """Every expert lives on this rank: dispatch and combine are the identity.

    The dispatcher protocol: `dispatch(rows, row_prob, tokens_per_expert)` takes the
    expert-sorted rows (R, D), their router probabilities (R,) and the (E,) counts, and
    returns (rows grouped by *local* expert, their probabilities, (E_local,) counts, handle);
    `combine(rows, handle)` sends expert outputs back and returns them in the original
    expert-sorted order (R, D).
    """

    def dispatch(self, rows, row_prob, tokens_per_expert):
        return rows, row_prob, tokens_per_expert, None

    def combine(self, rows, handle):
        return rows


class GroupedExperts(nn.Module):
    """The experts' squared-ReLU MLPs as (E, D, H) and (E, H, D) weights; `communication.py`
    slices them to this rank's experts under expert parallelism."""

    def __init__(self, num_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        # grad_reduce=invariant (set by parallelize.py, on every layout): `_InvariantExperts`.
        self.invariant = False
        # take(source, expert, grad_w1, grad_w2), set by the training loop under EP: each
        # (expert, source rank) segment's weight gradients go there instead of to .grad.
        self.take_grad = None

    def forward(self, rows, tokens_per_expert, row_prob, gemm: str, source_counts=None) -> torch.Tensor:
        """Rows (M, D) grouped by expert -> (M, D), scaled by row_prob when the grouped GEMM
        is a `samebits.kernels` one (it fuses the scaling and computes dprob itself).
        ``source_counts`` (E, W): each expert's rows per source rank, in that order."""
        if gemm == "torch" and self.invariant:
            counts = (source_counts if source_counts is not None else tokens_per_expert[:, None]).tolist()
            return _InvariantExperts.apply(rows, self.w1, self.w2, counts, self.take_grad)
        if gemm == "torch":
            counts = tokens_per_expert.tolist()  # host sync: split sizes
            outs = [squared_relu(xe @ self.w1[e]) @ self.w2[e]
                    for e, xe in enumerate(rows.split(counts))]
            return torch.cat(outs) if outs else rows.new_zeros(rows.shape)
        grouped_gemm_dprob = _kernel("grouped_gemm_dprob", "moe_grouped_gemm", gemm)
        variant = gemm.removeprefix("triton_")
        ones = torch.ones_like(row_prob).detach()
        hidden = squared_relu(grouped_gemm_dprob(rows, self.w1, tokens_per_expert, ones,
                                                 variant=variant))
        return grouped_gemm_dprob(hidden, self.w2, tokens_per_expert, row_prob, variant=variant)


class _InvariantExperts(torch.autograd.Function):
    """The experts with the same bits at every EP size (grad_reduce=invariant).

    Forward and input gradient: one GEMM per expert over the rows of every source rank
    (`invariant.gemm_matmul`: a row's bits are its own, whatever else is in the GEMM), so an
    expert costs two GEMMs a pass however many ranks send it rows.  Weight gradients sum over
    rows, and each source's rows are one micro-batch, which the step adds in int64 with the
    others: one GEMM per (expert, source) segment, of that micro-batch's rows alone (the
    product one rank computes for it), handed to ``take(source, expert, grad_w1, grad_w2)``
    under EP, or the parameters' gradients where a rank holds every source (one).
    ``counts``: (E, W) nested lists, each expert's rows per source, rows grouped so."""

    @staticmethod
    def forward(ctx, rows, w1, w2, counts, take):
        with torch.autocast(rows.device.type, enabled=False):  # the experts keep the parameters' dtype
            hidden, outs, offset = [], [], 0
            for e, per_source in enumerate(counts):
                x = rows[offset:offset + sum(per_source)]
                offset += x.shape[0]
                h = invariant.gemm_matmul(x, w1[e]) if x.shape[0] else x.new_zeros(0, w1.shape[2])
                hidden.append(h)
                outs.append(invariant.gemm_matmul(squared_relu(h), w2[e]) if x.shape[0] else x)
        ctx.save_for_backward(rows, w1, w2, torch.cat(hidden))
        ctx.counts, ctx.take = counts, take
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out):
        rows, w1, w2, hidden = ctx.saved_tensors
        take, matmul = ctx.take, invariant.gemm_matmul
        grad_w1 = torch.zeros_like(w1) if take is None else None
        grad_w2 = torch.zeros_like(w2) if take is None else None
        grad_rows, offset = [], 0
        for e, per_source in enumerate(ctx.counts):
            n = sum(per_source)
            x, h, dy = rows[offset:offset + n], hidden[offset:offset + n], grad_out[offset:offset + n]
            offset += n
            if n == 0:
                grad_rows.append(x)
                continue
            relu = F.relu(h)
            dh = matmul(dy, w2[e].t()) * (2 * relu)  # d(relu(h)^2)/dh = 2 relu(h)
            grad_rows.append(matmul(dh, w1[e].t()))
            start = 0
            for source, num_rows in enumerate(per_source):
                if num_rows == 0:
                    continue
                seg = slice(start, start + num_rows)
                start += num_rows
                gw1, gw2 = matmul(x[seg].t(), dh[seg]), matmul(relu[seg].square().t(), dy[seg])
                if take is not None:
                    take(source, e, gw1, gw2)
                else:
                    assert len(per_source) == 1, "several sources need take_grad (InvariantExpertGradients)"
                    grad_w1[e], grad_w2[e] = gw1, gw2  # one source: a rank's own micro-batch
        return torch.cat(grad_rows), grad_w1, grad_w2, None, None


def _kernel(name: str, option: str, value: str):
    """A `samebits.kernels` function (Triton loads on its first call); a missing one is a
    config error."""
    try:
        return getattr(kernels, name)
    except AttributeError as err:
        raise ConfigError(f"{option}={value!r} needs samebits.kernels.{name}, which this samebits does "
                          f"not have ({err}); use {option}="
                          f"{'index_add' if option == 'moe_combine' else 'torch'}") from err


class MoE(nn.Module):
    """Top-k routed experts.  Returns (output, load-balancing loss)."""

    def __init__(self, cfg: RecipeConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.moe_top_k
        self.jitter_eps = cfg.moe_jitter_eps
        self.combine_mode, self.gemm_mode = cfg.moe_combine, cfg.moe_grouped_gemm
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.d_model, cfg.moe_ffn_hidden_size)
        self.dispatcher = LocalDispatcher()
        self.jitter_generator: torch.Generator | None = None  # set by the training loop

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq_len, dim = x.shape
        x = x.reshape(-1, dim)  # (N, D)
        num_tokens = x.shape[0]
        router_in = x
        if self.training and self.jitter_eps > 0:  # Switch Transformer input jitter
            noise = torch.empty_like(x).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps,
                                                 generator=self.jitter_generator)
            router_in = x * noise
        probs = self.router(router_in).float().softmax(dim=-1)  # (N, E)
        top_prob, top_expert = probs.topk(self.top_k, dim=-1, sorted=True)  # (N, K)
        top_prob = top_prob / top_prob.sum(dim=-1, keepdim=True)

        # Load balancing (Switch): E * sum_e (fraction of rows to e) * (mean prob of e).
        tokens_per_expert = torch.bincount(top_expert.reshape(-1), minlength=self.num_experts)
        fraction = tokens_per_expert.float() / (num_tokens * self.top_k)  # (E,)
        load_balancing_loss = self.num_experts * (fraction * probs.mean(dim=0)).sum()

        # Sort the N*K (token, k) rows by expert; stable, so rows keep token order per expert.
        order = torch.argsort(top_expert.reshape(-1), stable=True)  # (R,) row -> flat (t, k)
        row_token = order // self.top_k  # (R,) token of each expert-sorted row
        row_prob = top_prob.reshape(-1).index_select(0, order)  # (R,)
        if self.combine_mode == "index_put_accumulate":
            rows = x[row_token]  # backward: index_put_(accumulate=True), thread-order sums
        else:
            rows = x.index_select(0, row_token)  # backward: index_add_, deterministic

        prob_in_gemm = self.gemm_mode != "torch"
        local_rows, local_prob, local_counts, handle = self.dispatcher.dispatch(
            rows, row_prob, tokens_per_expert)
        local_out = self.experts(local_rows, local_counts, local_prob, self.gemm_mode,
                                 source_counts=getattr(handle, "source_counts", None))
        out_rows = self.dispatcher.combine(local_out, handle)  # (R, D) expert-sorted
        out = self._combine(out_rows, row_prob, row_token, order, top_prob,
                            scaled=prob_in_gemm, num_tokens=num_tokens)
        return out.view(batch, seq_len, dim), load_balancing_loss

    def _combine(self, out_rows, row_prob, row_token, order, top_prob, *, scaled, num_tokens):
        """out[t] = sum over t's rows of prob * expert output (prob already applied if scaled)."""
        if self.combine_mode.startswith("triton_"):
            moe_combine = _kernel("moe_combine", "moe_combine", self.combine_mode)
            slot_index = torch.argsort(order).view(-1, self.top_k)  # (N, K) inverse permutation
            prob = torch.ones_like(top_prob) if scaled else top_prob
            return moe_combine(out_rows, prob, slot_index,
                               variant=self.combine_mode.removeprefix("triton_"))
        weighted = out_rows if scaled else out_rows * row_prob.unsqueeze(1)  # (R, D)
        out = weighted.new_zeros(num_tokens, weighted.shape[1])  # (N, D)
        if self.combine_mode == "index_put_accumulate":
            return out.index_put((row_token,), weighted, accumulate=True)
        return out.index_add(0, row_token, weighted)


class Block(nn.Module):
    """Pre-norm transformer block; the feed-forward part is dense or MoE."""

    def __init__(self, cfg: RecipeConfig, moe: bool):
        super().__init__()
        self.dropout = cfg.dropout
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = MoE(cfg) if moe else MLP(cfg.d_model, cfg.ffn_hidden_size)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, T, D) -> (same shape, the MoE load-balancing loss or None for a dense block)."""
        # Dropout draws from torch's global RNG: a state a bitwise resume must restore.
        x = x + F.dropout(self.attn(self.attn_norm(x)), self.dropout, self.training)
        ffn_out, aux = self.ffn(self.ffn_norm(x)), None
        if isinstance(ffn_out, tuple):
            ffn_out, aux = ffn_out
        return x + F.dropout(ffn_out, self.dropout, self.training), aux


class MTPModule(nn.Module):
    """One MTP depth: combine the previous depth's hidden state at t with the embedding of
    token t+d, then one dense block."""

    def __init__(self, cfg: RecipeConfig):
        super().__init__()
        self.hidden_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.embed_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg, moe=False)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.proj(torch.cat((self.hidden_norm(hidden), self.embed_norm(embedded)), dim=-1))
        return self.block(x)[0]


class Transformer(nn.Module):
    def __init__(self, cfg: RecipeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        moe_ids = set(cfg.moe_layer_ids)
        # A dict keyed "0".."L-1" (names as a list's): a pipeline stage deletes the others.
        self.layers = nn.ModuleDict({str(i): Block(cfg, moe=i in moe_ids)
                                     for i in range(cfg.num_layers)})
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.mtp_num_layers))

    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, init_std) matrices and embeddings, output projections scaled down by
        sqrt(2 * num_layers) (GPT-2); norms at one.  One generator, fixed module order."""
        std = self.cfg.init_std
        for name, param in self.named_parameters():
            if param.dim() == 1:
                nn.init.ones_(param)
                continue
            scale = 1 / math.sqrt(2 * self.cfg.num_layers) if name.endswith(
                ("attn.out.weight", "down.weight", "experts.w2")) else 1.0
            with torch.no_grad():
                param.normal_(0.0, std * scale, generator=generator)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def forward(self, tokens: torch.Tensor) -> ModelOutput:  # tokens: (B, T) inputs
        embedded = self.embed_tokens(tokens)  # (B, T, D)
        h, aux_sum = self.run_layers(embedded, embedded.new_zeros(()))
        return self.head(h, embedded, aux_sum)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, D) embeddings (the MTP modules read them too)."""
        if self.cfg.embedding_backward == "index_put_accumulate":
            return self.embed.weight[tokens]  # backward: index_put_(accumulate=True)
        return self.embed(tokens)  # dense backward, deterministic on CPU

    def run_layers(self, h: torch.Tensor, aux_sum: torch.Tensor):
        """The blocks this model holds, in order; adds each MoE block's load-balancing loss
        to `aux_sum`.  Returns (h, aux_sum)."""
        for layer in self.layers.values():
            h, aux = layer(h)
            if aux is not None:
                aux_sum = aux_sum + aux
        return h, aux_sum

    def head(self, h: torch.Tensor, embedded: torch.Tensor, aux_sum: torch.Tensor) -> ModelOutput:
        """Final norm and output layer, the MTP depths, and the mean load-balancing loss."""
        logits = self.output(self.norm(h))  # (B, T, V)
        mtp_logits = []
        for depth, module in enumerate(self.mtp, start=1):
            # hidden at t (t < T-depth) + embedding of token t+depth -> predicts t+1+depth
            h = module(h[:, :-1], embedded[:, depth:])  # (B, T-depth, D)
            mtp_logits.append(self.output(self.norm(h)))
        num_moe = len(self.cfg.moe_layer_ids)
        return ModelOutput(logits, mtp_logits, aux_sum / num_moe if num_moe else aux_sum)
