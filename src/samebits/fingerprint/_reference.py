"""Reference body sum of the digest in plain torch ops: runs on any device, defines the answer.

The spec's step 3 written for clarity: the fallback without the compiled library or a device
kernel, and the oracle those are tested against.  torch has no uint64, so words are int64:
+, * and sum wrap mod 2^64 like unsigned arithmetic, and x >> 32 is masked after the
arithmetic shift.  No op reads a value back to the host.
"""

from __future__ import annotations

import torch

from samebits.fingerprint._spec import GOLDEN, MASK64, MIX_KEYS
from samebits.errors import ConfigError

# Words per batch of ops.  On CPU, small enough that the two int64 work buffers stay in cache
# (each op of a batch then runs at memory speed instead of faulting in fresh pages); elsewhere,
# big enough that kernel launches are few.
_WORDS_PER_BATCH_CPU = 1 << 18
_WORDS_PER_BATCH_DEVICE = 1 << 24


def _as_int64(x: int) -> int:
    """The int64 with the same 64 bits as unsigned `x`."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


_GOLDEN = _as_int64(GOLDEN)
_LOW_32_BITS = (1 << 32) - 1


def _mix2_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """mix2 (docs/digest.md, step 3), in place on int64 `x`; `scratch` is a buffer like `x`."""
    for key in MIX_KEYS:
        torch.bitwise_and(x, _LOW_32_BITS, out=scratch)
        scratch *= key
        x ^= scratch
        torch.bitwise_left_shift(x, 32, out=scratch)  # low half up
        x >>= 32  # arithmetic shift: the high half down, sign bits above it...
        x &= _LOW_32_BITS  # ...masked off
        x |= scratch
    return x


def mix2(x: torch.Tensor) -> torch.Tensor:
    """mix2, elementwise on an int64 tensor."""
    return _mix2_(x.clone(), torch.empty_like(x))


def body_sum(data: torch.Tensor) -> torch.Tensor:
    """Body sum S of a tensor's bytes (1-D uint8 ``data``) as a 0-dim int64 on its device."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ConfigError(
            f"body_sum takes the 1-D uint8 bytes of a tensor, got dtype {data.dtype} with "
            f"{data.dim()} dims; pass t.contiguous().reshape(-1).view(torch.uint8)"
        )
    return body_sum_at(data, 0)


def body_sum_at(data: torch.Tensor, first_word: int) -> torch.Tensor:
    """`body_sum` of `data` as if its first word had index `first_word` (< 2**62) in a larger
    tensor (tests of tensors too big to allocate)."""
    data = data.detach().contiguous()
    device = data.device
    num_bytes = data.numel()
    num_full = num_bytes // 8
    total = torch.zeros((), dtype=torch.int64, device=device)
    batch = _WORDS_PER_BATCH_CPU if device.type == "cpu" else _WORDS_PER_BATCH_DEVICE
    mixed = torch.empty(min(batch, num_full), dtype=torch.int64, device=device)
    scratch = torch.empty_like(mixed)
    for start in range(0, num_full, batch):
        stop = min(start + batch, num_full)
        chunk = data[8 * start : 8 * stop]
        if chunk.storage_offset() % 8:  # view(int64) needs an 8-byte aligned offset
            chunk = chunk.clone()
        x = mixed[: stop - start]
        torch.arange(first_word + start + 1, first_word + stop + 1, out=x)  # j + 1
        x *= _GOLDEN
        x += chunk.view(torch.int64)
        total += _mix2_(x, scratch[: stop - start]).sum()
    if num_bytes % 8:  # the tail word, zero-padded
        tail = torch.zeros(8, dtype=torch.uint8, device=device)
        tail[: num_bytes % 8] = data[8 * num_full :]
        offset = _as_int64((first_word + num_full + 1) * GOLDEN)
        total += mix2(tail.view(torch.int64) + offset).sum()
    return total
