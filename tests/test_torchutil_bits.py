"""The foundation's bit helpers (`samebits._torchutil.int_view`, `ordered_bits`), which the digest,
the tracer's nudge, the probe, the rerun fault, the byte tests and the distances share."""

from __future__ import annotations

import pytest
import torch

from samebits._torchutil import int_view, ordered_bits
from samebits.rerun import FaultSpec, _FlipMode
from samebits.trace._tensors import nudge

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float8_e4m3fn,
          torch.float8_e5m2, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32,
          torch.complex64, torch.complex128]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int_view_is_the_integer_of_the_element_size_with_the_same_bits(dtype):
    raw = torch.arange(96, dtype=torch.uint8) % (2 if dtype is torch.bool else 251)  # a bool byte is 0 or 1
    t = raw.view(dtype).reshape(-1, 2).t()  # non-contiguous
    view = int_view(t)
    assert view.element_size() == t.element_size() and view.shape == t.shape
    if dtype is torch.complex128:  # no integer has 16 bytes
        assert view is t
    else:
        assert not view.is_floating_point() and not view.is_complex() and view.dtype is not torch.bool
        assert view.contiguous().view(torch.uint8).tolist() == t.contiguous().view(torch.uint8).tolist()


def test_nudge_moves_a_complex128_first_real_part_by_one_ulp():
    # the old nudge looked complex128 up by its 16-byte element size, which has no integer (KeyError)
    t = torch.tensor([1.5 - 2j, 3j], dtype=torch.complex128)
    nudge(t)
    assert t[0].real.item() == torch.nextafter(torch.tensor(1.5, dtype=torch.float64), torch.tensor(2.0)).item()
    assert t[0].imag.item() == -2.0 and t[1].item() == 3j


def test_the_flip_fault_flips_a_float8_output():
    # the old fault had no 1-byte integer in its table: a float8 output raised KeyError in the step
    x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    with _FlipMode(FaultSpec(step=0, rank=0, op="clone", bit=2)) as mode:
        y = x.clone()
    assert mode.flipped
    assert (y.view(torch.uint8) ^ x.view(torch.uint8)).tolist() == [4, 0]


def test_the_flip_fault_flips_a_non_contiguous_output_itself():
    # the old fault flipped reshape(-1)'s copy of a strided output and still said it had flipped
    x = torch.ones(3, 4).t()
    with _FlipMode(FaultSpec(step=0, rank=0, op="clone", bit=2)) as mode:
        y = x.clone()  # a new tensor with x's transposed strides
    assert mode.flipped and not y.is_contiguous()
    assert (y.view(torch.int32) ^ x.view(torch.int32)).flatten().tolist() == [4] + [0] * 11


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16], ids=str)
def test_ordered_bits_counts_every_representable_value_once_in_value_order(dtype):
    width = 8 * dtype.itemsize
    unsigned = torch.arange(1 << width, dtype=torch.int64)  # every bit pattern
    patterns = unsigned.to(torch.int8 if width == 8 else torch.int16)  # the same bits, read signed
    values = patterns.view(dtype).to(torch.float64)
    order = ordered_bits(unsigned, width)
    assert torch.equal(order, ordered_bits(patterns.to(torch.int64), width))  # sign-extended reads the same
    assert [ordered_bits(int(b), width) for b in unsigned[:: 1 << (width - 6)]] == order[:: 1 << (width - 6)].tolist()
    finite = values.isfinite()
    by_value = order[finite][values[finite].argsort(stable=True)]
    assert (by_value.diff() >= 0).all()  # monotonic in value
    assert by_value.unique().tolist() == list(range(int(by_value.min()), int(by_value.max()) + 1))  # one step per value
    zeros = order[values == 0]
    assert zeros.tolist() == [0, 0]  # +0 and -0
