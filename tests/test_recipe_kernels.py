"""Byte tests of the reference recipe's own autograd Functions (registered in
src/samebits/kernels/kernel-coverage.toml, so `samebits coverage samebits` covers the recipe too):

* `_DelayedFloat8MM` (fp8 delayed scaling, emulated GEMMs): forward, input and weight gradients,
  and the amax histories it writes, repeat bit for bit at 1 and 2 threads;
* `_BlockScaledMM` (MXFP8 / NVFP4, emulated): the same, and its output is the fp32 product of the
  quantised operands exactly as the formats define them;
* `_AllToAll` (expert-parallel dispatch): the exchange and its reverse in the backward, on a
  one-rank gloo group (bytes only; the 2-rank exchange is in tests/test_recipe.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from samebits.recipes import precision
from samebits.recipes.communication import _AllToAll
from samebits.testing import assert_same_bits

torch_ao = pytest.importorskip("torchao", reason="the precision extra (torchao) is not installed: "
                               "pip install -e '.[precision]'")


def _inputs(rows=12, cols=64, out=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=gen), torch.randn(out, cols, generator=gen) * 0.1


class _Delayed(torch.nn.Module):
    """Three steps through one delayed-scaling layer: each step's scales come from the history."""

    def __init__(self, weight):
        super().__init__()
        self.linear = precision.DelayedFloat8Linear(weight.shape[1], weight.shape[0], history_len=4, emulate=True)
        with torch.no_grad():
            self.linear.weight.copy_(weight)

    def forward(self, x):
        outs = [self.linear(x * (1 + step)) for step in range(3)]
        return torch.stack(outs), self.linear.amax_history.clone()


@pytest.mark.bitwise(runs=2, threads=[1, 2])
def test_delayed_fp8_mm_repeats_with_its_histories():
    x, weight = _inputs()
    model = _Delayed(weight)
    x.requires_grad_(True)
    return model(x), model, x  # outputs and histories; gradients of the weight and of x


@pytest.mark.bitwise(runs=2, threads=[1, 2])
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_mm_repeats(fmt):
    x, weight = _inputs()
    x.requires_grad_(True)
    weight.requires_grad_(True)
    return precision._BlockScaledMM.apply(x, weight, fmt), x, weight  # the output; grads of x and weight


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_block_scaled_mm_is_the_product_of_the_quantised_operands(fmt):
    x, weight = _inputs()
    out = precision._BlockScaledMM.apply(x, weight, fmt)
    expected = precision.quantize_dequantize(x, fmt) @ precision.quantize_dequantize(weight, fmt).t()
    assert_same_bits(out, expected)
    assert not torch.equal(out, x @ weight.t())  # the formats did round something


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('a2a') / 'init'}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.bitwise(runs=2)
def test_all_to_all_exchange_and_its_reverse(one_rank_group):
    rows = torch.arange(30, dtype=torch.float32).view(10, 3).requires_grad_(True)
    out = _AllToAll.apply(rows * 1.5, [10], [10], None)
    assert_same_bits(out.detach(), rows.detach() * 1.5)  # one rank: the exchange is the identity
    return out, rows  # the output; the gradient of rows through the reverse exchange
