"""Torch reference implementations of the kernels: the definition of what each kernel computes.

They are the CPU fallback when Triton cannot run, the `variant="torch"` choice, and what the
tests compare against (in float64).  They are deterministic at a fixed thread count: they
avoid `index_put_(accumulate=True)` and the backward of advanced indexing, which vary from
call to call with more than one CPU thread (see docs/kernels.md).  The digest's reference is
the fingerprint package's `samebits.fingerprint._reference.body_sum`: one definition.
"""

from __future__ import annotations

import torch

from samebits.errors import ConfigError


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def reference_grouped_gemm_dprob(
    x: torch.Tensor,  # (T, K) rows sorted by expert
    weight: torch.Tensor,  # (E, K, N)
    tokens_per_expert: torch.Tensor,  # (E,) integer, sums to T
    prob: torch.Tensor,  # (T,) router probability of each row
) -> torch.Tensor:  # (T, N) in x.dtype
    """y[t] = prob[t] * (x[t] @ weight[e(t)]), where rows of expert e are the e-th run of
    `tokens_per_expert[e]` rows.  The product is rounded to x.dtype, then scaled in fp32 (or
    fp64 for fp64 inputs) and rounded again, as an MoE layer does.

    Differentiable in x, weight and prob: autograd gives dprob[t] = sum_n dy[t, n] * Y[t, n]
    with Y = x @ weight[e] (the quantity the Triton dprob epilogue computes).  Syncs the host
    once (`tokens_per_expert.tolist()`); the Triton path does not.
    """
    counts = tokens_per_expert.tolist()
    if sum(counts) != x.shape[0]:
        raise ConfigError(
            f"tokens_per_expert sums to {sum(counts)} but x has {x.shape[0]} rows; "
            "the rows of x must be exactly the tokens routed to each expert, sorted by expert"
        )
    products = [xe @ weight[e] for e, xe in enumerate(x.split(counts))]  # each (T_e, N)
    y = torch.cat(products) if products else x.new_empty((0, weight.shape[2]))  # (T, N)
    acc = _accumulate_dtype(x.dtype)
    return (prob.to(acc)[:, None] * y.to(acc)).to(x.dtype)


def reference_moe_combine(
    expert_out: torch.Tensor,  # (R, H) expert outputs, one row per routed (token, k)
    prob: torch.Tensor,  # (T, K) top-k router probabilities
    slot_index: torch.Tensor,  # (T, K) integer row of expert_out for token t's k-th expert
) -> torch.Tensor:  # (T, H) in expert_out.dtype
    """out[t] = sum_k prob[t, k] * expert_out[slot_index[t, k]], summed in k order in fp32
    (fp64 for fp64 inputs), rounded once to expert_out.dtype.

    Gathers with `index_select`, whose backward (`index_add_`) is deterministic on CPU.
    """
    num_tokens, top_k = slot_index.shape
    acc = _accumulate_dtype(expert_out.dtype)
    rows = torch.index_select(expert_out, 0, slot_index.reshape(-1))  # (T*K, H)
    rows = rows.reshape(num_tokens, top_k, expert_out.shape[1]).to(acc)  # (T, K, H)
    out = torch.zeros(
        (num_tokens, expert_out.shape[1]), dtype=acc, device=expert_out.device
    )  # (T, H)
    for k in range(top_k):  # explicit k order, as the deterministic kernel does
        out = out + prob[:, k].to(acc)[:, None] * rows[:, k]
    return out.to(expert_out.dtype)
