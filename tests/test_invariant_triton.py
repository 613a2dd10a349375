"""The Triton kernels of the invariant reduction's block fixed point (kernels/_triton_fixed.py)
against their definition, the torch functions of samebits.invariant._fixed, run by Triton's
CPU interpreter (TRITON_INTERPRET=1, set by tests/conftest.py before Triton loads): the same
int64 sums, inexact counts and fp32 bits on the mixed data of tests/test_invariant_native.py
(tiny shapes: the interpreter runs a kernel in numpy)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from samebits.invariant._fixed import decode_into, encode_sum, fraction_bits, max_block_exponents

from test_invariant_native import _bits_equal, _blocks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """TRITON_INTERPRET=1 for this module; skip if the kernels were compiled for a GPU earlier
    in this process (they cannot take CPU tensors then)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        from triton.runtime.interpreter import InterpretedFunction

        module = sys.modules.get("samebits.kernels._triton_fixed")
        if module and not isinstance(module._encode_kernel, InterpretedFunction):
            pytest.skip("samebits.kernels was compiled for a GPU earlier in this process")
        yield


@pytest.mark.parametrize("block_size,num_buffers,num_micro_batches", [(1, 2, 2), (256, 1, 1), (7, 3, 1 << 20)])
def test_triton_encode_sum_and_decode_have_the_reference_bits(block_size, num_buffers, num_micro_batches):
    num_blocks = 3000 if block_size == 1 else 40
    bits = fraction_bits(num_micro_batches)
    buffers = [_blocks(num_blocks, block_size, seed=7 * block_size + j) for j in range(num_buffers)]
    exps = max_block_exponents(buffers, backend="torch")
    total, inexact = encode_sum(buffers, exps, bits, backend="torch")
    kernel_total, kernel_inexact = encode_sum(buffers, exps, bits, backend="triton")
    assert torch.equal(kernel_total, total)
    assert kernel_inexact == inexact and inexact > 0
    assert _bits_equal(decode_into(total, exps, bits, backend="triton"), decode_into(total, exps, bits, backend="torch"))


def test_triton_decode_rounds_like_the_reference():
    """Random sums under exponents of every kind, with ties on the subnormal grid."""
    bits = fraction_bits(4)
    gen = torch.Generator().manual_seed(3)
    exps = torch.randint(-128, 128, (500,), generator=gen, dtype=torch.int64).to(torch.int8)
    magnitude = torch.randint(0, 63, (500, 8), generator=gen)
    sums = torch.randint(-(1 << 62), 1 << 62, (500, 8), generator=gen) >> (62 - magnitude)
    grid = (bits - exps.long() - 149).clamp(min=1)[:, None].expand_as(sums)
    halfway = (sums >> grid << grid) + (torch.ones_like(sums) << (grid - 1))
    sums = torch.where(torch.rand(sums.shape, generator=gen) < 0.3, halfway, sums).contiguous()
    parts = [torch.randint(-(1 << 62), 1 << 62, sums.shape, generator=gen)]
    expected = decode_into(sums, exps, bits, backend="torch")
    assert _bits_equal(decode_into(sums - parts[0], exps, bits, addends=parts, backend="triton"), expected)
