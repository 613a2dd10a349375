"""Public digest body: the fused Triton kernel, or the torch reference when Triton cannot run."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from samebits.fingerprint import reference_body_sum as body_sum
from samebits.kernels import _backend
from samebits.errors import ConfigError


def digest_body(data: torch.Tensor) -> torch.Tensor:
    """Body of the samebits tensor digest, in one pass over the bytes.

    Args:
        data: (L,) contiguous uint8: a tensor's logical bytes, row-major, little-endian
            (the fingerprint package makes them so).  Any start address; 8-byte aligned data
            is read as uint64 words, other data as bytes.

    Returns:
        0-dim int64 on data.device holding the two's complement of
        S = sum_j mix2(w_j + (j + 1) * 0x9E3779B97F4A7C15) mod 2^64 (digest version 2; mix2
        is in docs/digest.md), where w_j are the
        little-endian uint64 words of data zero-padded to a multiple of 8.  0 for L = 0.
        Bit-for-bit the reference body; no host sync.

    Uses `samebits.fingerprint.reference_body_sum` (the definition: same bits, slower)
    when Triton cannot run on data.device.
    """
    if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
        raise ConfigError(
            f"digest_body: expected a contiguous 1-D uint8 tensor of bytes, got {data.dtype} "
            f"{tuple(data.shape)} (contiguous={data.is_contiguous()}); pass "
            "t.contiguous().view(torch.uint8).reshape(-1)"
        )
    if not _backend.triton_runs_on(data.device):
        return body_sum(data)
    from samebits.kernels import _triton_digest

    return _triton_digest.digest_body(data)


def digest_body_many(datas: Sequence[torch.Tensor]) -> torch.Tensor:
    """`digest_body` of each tensor, stacked: (n,) int64 on the device of the first tensor.

    One launch pair per tensor (no host sync); all tensors must be on one device.
    """
    if not datas:
        return torch.zeros(0, dtype=torch.int64)
    device = datas[0].device
    bodies = []
    for i, data in enumerate(datas):
        if data.device != device:
            raise ConfigError(
                f"digest_body_many: tensor {i} is on {data.device}, tensor 0 on {device}; "
                "digest each device's tensors in its own call"
            )
        bodies.append(digest_body(data))
    return torch.stack(bodies)
