"""The native block fixed point (fingerprint/csrc/fixed.c) against its definition, the torch
functions of samebits.invariant._fixed: the same exponents, int64 sums, inexact counts and fp32
bits on data built to reach every branch (mixed scales, zeros, subnormals, inf/nan blocks,
tiny blocks on the float64 path, the subnormal grid of the decode, block sizes 1 and 256,
1 to 5 micro-batches, fraction bits from 62 down to 30), for the three passes and the fused one."""

from __future__ import annotations

import pytest
import torch

from samebits.errors import ConfigError
from samebits.fingerprint import native_available
from samebits.invariant import _fixed, _fixed_native
from samebits.invariant._fixed import (EXPONENT_NONFINITE, decode_into, encode_sum, fraction_bits,
                                       max_block_exponents, reduce_here)

needs_library = pytest.mark.skipif(_fixed_native.LIB is None, reason="the native fixed-point library is not built")


def test_native_library_is_built_beside_the_digest_library():
    """setup.py builds both with the same compiler: one without the other is a stale build."""
    assert _fixed_native.LIB is not None or not native_available(), (
        "samebits/invariant/_libfixed*.so is missing or stale while the digest library is built: rebuild with "
        "`pip install -e .`")


def test_a_library_not_built_or_of_another_version_is_not_used():
    from samebits._cdll import load_library

    assert load_library("samebits.invariant._libfixed_not_built", "samebits_fixed_abi_version", 3, "-") is None
    if _fixed_native.LIB is None:
        pytest.skip("the fixed-point library is not built (pip install -e .)")
    with pytest.warns(UserWarning, match="from another samebits version; the torch path runs"):
        assert load_library("samebits.invariant._libfixed", "samebits_fixed_abi_version", 999,
                            "the torch path runs") is None


def _blocks(num_blocks: int, block_size: int, seed: int, nonfinite: bool = True) -> torch.Tensor:
    """fp32 blocks, each of its own kind (the same in every micro-batch: the kinds come from
    ``block_size`` alone): normal at a random scale 2**-140..2**120 (some spanning 40 binary
    orders, so elements lose low bits), zeros, subnormals, one element, signed zeros, inf/nan."""
    kind = torch.randint(0, 10, (num_blocks, 1), generator=torch.Generator().manual_seed(block_size))
    gen = torch.Generator().manual_seed(seed)
    scale = torch.pow(2.0, torch.randint(-140, 121, (num_blocks, 1), generator=gen).double())
    x = torch.randn(num_blocks, block_size, generator=gen, dtype=torch.float64) * scale
    spread = torch.pow(2.0, -torch.randint(0, 40, (num_blocks, block_size), generator=gen).double())
    x = torch.where(kind == 1, x * spread, x)
    x = torch.where(kind == 2, torch.zeros_like(x), x)
    subnormal = torch.randint(-(1 << 23), 1 << 23, (num_blocks, block_size), generator=gen).double() * 2.0 ** -149
    x = torch.where(kind == 3, subnormal, x)
    x = torch.where((kind == 4) & (torch.rand(x.shape, generator=gen) < 0.9), torch.zeros_like(x), x)
    x = torch.where(kind == 5, -torch.zeros_like(x), x)
    x = x.float()  # scales past fp32's range become inf: more non-finite blocks
    if nonfinite:
        special = torch.tensor([float("inf"), float("-inf"), float("nan")])[torch.randint(0, 3, (num_blocks, 1),
                                                                                            generator=gen)]
        hit = (kind == 6) & (torch.rand(x.shape, generator=gen) < 0.05)
        x = torch.where(hit, special.expand_as(x), x)
    else:
        x = torch.nan_to_num(x, posinf=0.0, neginf=0.0)
    return x.contiguous()


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


CASES = [(block_size, k, m) for block_size in (1, 256, 7) for k, m in ((1, 1), (2, 2), (3, 8), (5, 1 << 20))]


@needs_library
@pytest.mark.parametrize("block_size,num_buffers,num_micro_batches", CASES)
def test_native_path_has_the_reference_bits(block_size, num_buffers, num_micro_batches):
    num_blocks = 6000 if block_size == 1 else 300
    bits = fraction_bits(num_micro_batches)
    buffers = [_blocks(num_blocks, block_size, seed=100 * block_size + j) for j in range(num_buffers)]
    exps = max_block_exponents(buffers, backend="torch")
    assert torch.equal(max_block_exponents(buffers, backend="native"), exps)
    assert (exps == EXPONENT_NONFINITE).any() and (exps == _fixed.EXPONENT_MIN).any()
    assert ((bits - exps.long() > 126) & (exps != _fixed.EXPONENT_MIN)).any()  # the float64 path is reached

    total, inexact = encode_sum(buffers, exps, bits, backend="torch")
    native_total, native_inexact = encode_sum(buffers, exps, bits, backend="native")
    assert torch.equal(native_total, total)
    assert native_inexact == inexact and inexact > 0

    decoded = decode_into(total, exps, bits, backend="torch")
    assert _bits_equal(decode_into(total, exps, bits, backend="native"), decoded)

    # The fused pass (one rank, or the owner of its rows): the same bits and counts as the three.
    fused = torch.full_like(decoded, 7.0)
    counts = reduce_here(buffers, bits, out=fused, backend="native")
    assert _bits_equal(fused, decoded)
    assert counts == (inexact, int((exps == EXPONENT_NONFINITE).sum()))
    reference = torch.empty_like(decoded)
    assert reduce_here(buffers, bits, out=reference, backend="torch") == counts and _bits_equal(reference, decoded)


@needs_library
@pytest.mark.parametrize("num_micro_batches,block_size", [(1, 16), (4, 16), (1 << 32, 16), (8, 1), (2, 5000)])
def test_native_decode_rounds_like_the_reference(num_micro_batches, block_size):
    """Sums of every magnitude under exponents of every kind: the int64 -> fp32 rounding, the
    scale, the subnormal grid (half-way cases on it included) and the nan blocks; with partial
    sums added in the decode's pass (blocks longer than its 4096-element pieces included)."""
    bits = fraction_bits(num_micro_batches)
    gen = torch.Generator().manual_seed(num_micro_batches)
    num_blocks = 48000 // block_size + 3
    exps = torch.randint(-128, 128, (num_blocks,), generator=gen, dtype=torch.int64).to(torch.int8)
    magnitude = torch.randint(0, 63, (num_blocks, block_size), generator=gen)
    sums = torch.randint(-(1 << 62), 1 << 62, (num_blocks, block_size), generator=gen) >> (62 - magnitude)
    grid = (bits - exps.long() - 149).clamp(min=1)[:, None].expand_as(sums)
    halfway = (sums >> grid << grid) + (torch.ones_like(sums) << (grid - 1))  # ties on the subnormal grid
    sums = torch.where(torch.rand(sums.shape, generator=gen) < 0.3, halfway, sums).contiguous()
    expected = decode_into(sums, exps, bits, backend="torch")
    assert _bits_equal(decode_into(sums, exps, bits, backend="native"), expected)
    parts = [torch.randint(-(1 << 62), 1 << 62, sums.shape, generator=gen) for _ in range(3)]  # received partial sums
    assert _bits_equal(decode_into(sums - parts[0] - parts[1] - parts[2], exps, bits, addends=parts,  # wraps: exact
                                   backend="native"), expected)
    assert (expected != 0).any() and (expected.abs() < 2.0 ** -126).logical_and(expected != 0).any()


@needs_library
def test_native_path_writes_into_given_buffers_and_auto_picks_it():
    buffers = [_blocks(64, 256, seed=j, nonfinite=False) for j in range(2)]
    exps = max_block_exponents(buffers)
    out = torch.full((64, 256), -1, dtype=torch.int64)
    total, inexact = encode_sum(buffers, exps, 61, out=out)
    assert total.data_ptr() == out.data_ptr()
    assert torch.equal(total, encode_sum(buffers, exps, 61, backend="torch")[0])
    decoded = torch.empty(64, 256)
    assert decode_into(total, exps, 61, out=decoded).data_ptr() == decoded.data_ptr()
    assert _bits_equal(decoded, decode_into(total, exps, 61, backend="torch"))


@needs_library
def test_native_backend_refuses_what_it_cannot_take():
    with pytest.raises(ConfigError, match="backend='native'"):
        max_block_exponents([torch.zeros(4, 8, dtype=torch.float64)], backend="native")
    with pytest.raises(ConfigError, match="not one of"):
        max_block_exponents([torch.zeros(4, 8)], backend="fast")
    strided = torch.zeros(8, 8)[:, ::2]
    assert torch.equal(max_block_exponents([strided]), max_block_exponents([strided], backend="torch"))


@pytest.mark.parametrize("exponent", [-4096, -200, -60, 0, 5, 60, 61, 62, 63, 64, 130, 4096])
def test_native_square_sums_are_the_clipping_norms_integers(exponent):
    """The clipping norm's one pass a tensor (`_norm`): the same int64 sums as its torch
    definition, ties to even included (0.5**2 * 2 is 0.5), inf and nan as 0, any size."""
    from samebits.invariant._fixed import pow2_clamped
    from samebits.invariant._norm import _square_sum

    gen = torch.Generator().manual_seed(exponent & 0xFFFF)
    tensors = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8) for n in (0, 1, 7, 300_000)]
    tensors.append(torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3.4e38, float("inf"), float("-inf"), float("nan"),
                                 0.5, 1.5, -2.5, 1e-20, 2.0 ** -75, 2.0 ** 30]))
    scales = pow2_clamped(torch.full((len(tensors),), 62 - exponent))
    native = _fixed_native.square_sums(tensors, scales)
    assert native is not None
    assert torch.equal(native, torch.stack([_square_sum(t, scales[i]) for i, t in enumerate(tensors)]))
    assert _fixed_native.square_sums([tensors[3][::2]], scales[:1]) is None  # not contiguous: the torch path


@needs_library
def test_native_peaks_are_the_clipping_norms_largest_magnitudes():
    """The clipping norm's other pass (`_norm`): each tensor's largest |x| as torch's
    abs().amax() gives it, 0 for an empty tensor, nan where one holds nan (whatever else), inf
    where one holds inf and no nan; a strided tensor goes to the torch path."""
    gen = torch.Generator().manual_seed(7)
    tensors = [torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 8) for n in (0, 1, 7, 300_000)]
    tensors += [torch.tensor([0.0, -0.0]), torch.tensor([-1e-45, 1e-45, -3.0]), torch.tensor([1.0, float("-inf"), 2.0]),
                torch.tensor([float("inf"), float("nan"), -1.0]), torch.tensor([-0.0])]
    native = _fixed_native.peaks(tensors)
    expected = torch.stack([t.abs().amax() if t.numel() else torch.zeros(()) for t in tensors])
    assert torch.equal(native.isnan(), expected.isnan()) and expected.isnan().sum() == 1
    assert _bits_equal(native[~native.isnan()], expected[~expected.isnan()])
    assert _fixed_native.peaks([tensors[3][::2]]) is None
