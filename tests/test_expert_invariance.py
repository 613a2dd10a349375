"""The experts under grad_reduce=invariant (issue 37): what makes EP's bits those of one rank.

An owner computes, in one backward, the rows every source rank sent an expert: one GEMM per
expert for the forward and the input gradient (a row's bits its own, whatever else is in the
GEMM, at any thread count) and one weight-gradient GEMM per (expert, source) segment, each
that source's micro-batch alone; `InvariantExpertGradients` adds the segments' gradients of
the step in int64.  The recipe at ep2 and ep4 against one rank: tests/test_layout_invariance.py
(ep2) and `samebits verify --across single,ep2,ep4`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from samebits import invariant
from samebits.recipes.communication import InvariantExpertGradients
from samebits.recipes.config import RecipeConfig
from samebits.recipes.model import GroupedExperts, Transformer

# (expert, source) rows: segments of 1, 2 and 5 rows (below the 4 a GEMM needs for a row's bits
# to be its own) beside one of 37, and an expert one source sends nothing.
COUNTS = [[2, 37], [5, 1], [0, 6]]


def _experts(generator: torch.Generator) -> GroupedExperts:
    experts = GroupedExperts(len(COUNTS), 32, 48)
    with torch.no_grad():
        experts.w1.normal_(0.0, 0.2, generator=generator)
        experts.w2.normal_(0.0, 0.2, generator=generator)
    experts.invariant = True
    return experts


def test_each_sources_rows_and_weight_gradients_are_those_it_gives_alone():
    """Two sources' rows through the experts at once (2 threads: the GEMM's kernel would depend on
    the rows around a small segment) have the forward rows, input-gradient rows and per-segment
    weight gradients of each source's rows through the experts alone, bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(0)
        experts = _experts(generator)
        num_rows = sum(map(sum, COUNTS))
        rows, grad_out = torch.randn(num_rows, 32, generator=generator), torch.randn(num_rows, 32, generator=generator)
        taken = {}
        experts.take_grad = lambda source, expert, grad_w1, grad_w2: taken.__setitem__((source, expert),
                                                                                       (grad_w1, grad_w2))
        both = rows.clone().requires_grad_()
        tokens_per_expert = torch.tensor([sum(c) for c in COUNTS])
        out = experts(both, tokens_per_expert, None, "torch", source_counts=torch.tensor(COUNTS))
        out.backward(grad_out)
        assert experts.w1.grad is None and sorted(taken) == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]

        experts.take_grad = None
        starts = torch.tensor(COUNTS).reshape(-1).cumsum(0) - torch.tensor(COUNTS).reshape(-1)
        for source in range(2):
            index = torch.cat([torch.arange(int(starts[e * 2 + source]), int(starts[e * 2 + source]) + COUNTS[e][source])
                               for e in range(len(COUNTS))])
            alone = rows[index].clone().requires_grad_()
            experts.w1.grad = experts.w2.grad = None
            out_alone = experts(alone, torch.tensor([c[source] for c in COUNTS]), None, "torch")
            out_alone.backward(grad_out[index])
            assert torch.equal(out_alone, out[index]) and torch.equal(alone.grad, both.grad[index])
            for expert, per_source in enumerate(COUNTS):
                grad_w1, grad_w2 = taken.get((source, expert), (torch.zeros(32, 48), torch.zeros(48, 32)))
                assert torch.equal(grad_w1, experts.w1.grad[expert]) and torch.equal(grad_w2, experts.w2.grad[expert])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_rank_group(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_owners_sum_of_segment_gradients_is_the_int64_sum_of_the_micro_batches(one_rank_group):
    """Two backwards of two sources each (4 micro-batches; a source that sends an expert nothing
    contributes zeros): every expert weight's gradient is the accumulator's sum of the four,
    each element its own block (exponent the max over the four, int64, decoded once), which is
    the exact sum rounded once where fp32 in any order loses the small terms."""
    model = Transformer(RecipeConfig(num_layers=2, d_model=16, num_heads=2, num_experts=4, moe_ffn_hidden_size=24,
                                     vocab_size=64, seq_len=8, ep=1))
    model.init_weights(torch.Generator().manual_seed(0))
    owner = InvariantExpertGradients(model, num_micro_batches=4, ep=2)
    weights = [w for moe in model.moe_layers() for w in (moe.experts.w1, moe.experts.w2)]
    generator = torch.Generator().manual_seed(1)
    parts = {id(w): [] for w in weights}  # each weight's four contributions, as the owner should see them
    for _backward in range(2):
        for source in range(2):
            for layer, moe in enumerate(model.moe_layers()):
                w1, w2 = moe.experts.w1, moe.experts.w2
                full = [torch.zeros_like(w1), torch.zeros_like(w2)]
                for expert in range(4):
                    if (source + expert + layer) % 3 == 0:
                        continue  # this source sent the expert no rows
                    grads = [torch.randn(w.shape[1:], generator=generator) * 10.0 ** torch.randint(-6, 3, (1,)).item()
                             for w in (w1, w2)]
                    # 1 + tiny - 1 + tiny: fp32 in this order keeps one tiny term, the exact sum two
                    grads[0][0, 1] = 2.0 ** -30 if source else (1.0 if _backward == 0 else -1.0)
                    moe.experts.take_grad(source, expert, *grads)
                    full[0][expert], full[1][expert] = grads
                parts[id(w1)].append(full[0])
                parts[id(w2)].append(full[1])
        owner.micro_batch_done()
    owner.reduce()
    bits = invariant.fraction_bits(4)
    for weight in weights:
        flat = [p.reshape(-1, 1) for p in parts[id(weight)]]
        exps = invariant.block_exponents(flat[0])
        for part in flat[1:]:
            exps = torch.maximum(exps, invariant.block_exponents(part))
        expected = invariant.decode(sum(invariant.encode(p, exps, bits)[0] for p in flat), exps, bits)
        assert torch.equal(weight.grad.reshape(-1, 1), expected)
    w1 = model.moe_layers()[0].experts.w1  # expert 1 of layer 0: every source sent it rows
    assert w1.grad[1, 0, 1] == 2.0 ** -29 and sum(parts[id(w1)])[1, 0, 1] == 2.0 ** -30
