"""The recipe's list of reductions (issue 28): one list, the doc table is it, and a traced step
of the recipe has no reduction the list does not cover (and the check names one it plants)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from samebits.errors import SamebitsError
from samebits.recipes import reductions
from samebits.recipes.reductions import (RECIPE_REDUCTIONS, ReductionSite, check_reductions, is_reduction,
                                         markdown_table, uncovered)

DOC = Path(__file__).resolve().parents[1] / "docs" / "invariance.md"


@pytest.fixture(scope="module")
def step_sites() -> list[ReductionSite]:
    return check_reductions()  # raises, naming each, on a reduction the list does not cover


def _doc_table() -> str:
    section = DOC.read_text().split("### The reductions of the recipe's step", 1)[1]
    return "\n".join(line for line in section.splitlines() if line.startswith("|"))


def test_the_doc_table_is_the_list():
    assert _doc_table() == markdown_table()
    assert len(RECIPE_REDUCTIONS) == len(_doc_table().splitlines()) - 2


def test_every_reduction_of_the_recipes_step_is_listed_and_the_trace_sees_the_step(step_sites):
    seen = {(s.place, s.phase, str(s.op).rsplit(".", 1)[0]) for s in step_sites}
    # The trace sees forward and backward, inside modules and outside: not an empty pass.
    for expected in [("layers.0.attn.out", "forward", "aten.bmm"), ("layers.0.attn.qkv", "backward", "aten.bmm"),
                     ("layers.1.ffn", "forward", "aten.index_add"),
                     ("embed", "backward", "aten.embedding_dense_backward"),
                     ("recipes.loop._losses", "backward", "aten.nll_loss_backward"),
                     ("mtp.0.block.attn", "forward", "aten._scaled_dot_product_flash_attention_for_cpu")]:
        assert expected in seen, (expected, sorted(seen))
    assert not uncovered(step_sites)


def test_an_entry_removed_from_the_list_is_named_with_its_module_path_and_op(step_sites):
    without_sdpa = [e for e in RECIPE_REDUCTIONS if not e.reduction.startswith("attention scores")]
    assert len(without_sdpa) == len(RECIPE_REDUCTIONS) - 1
    messages = [site.message() for site in uncovered(step_sites, without_sdpa)]
    assert ("unlisted reduction: aten._scaled_dot_product_flash_attention_for_cpu.default in layers.0.attn "
            "(forward): add it to RECIPE_REDUCTIONS in samebits/recipes/reductions.py with its method "
            "(docs/invariance.md)") in messages
    assert any("_backward.default in mtp.0.block.attn (backward)" in m for m in messages), messages
    assert all(" in " in m and "attn" in m for m in messages), messages  # nothing else lost its entry


def test_a_planted_reduction_over_the_sequence_fails_the_check_naming_place_and_op():
    def plant(model):
        attn = model.layers["0"].attn
        forward = attn.forward
        # A sum over the sequence inside the attention module: a reduction no row lists there.
        attn.forward = lambda x: forward(x) + 0 * x.sum(dim=1, keepdim=True)

    with pytest.raises(SamebitsError) as err:
        check_reductions(model_hook=plant)
    lines = str(err.value).splitlines()
    assert "unlisted reduction: aten.sum.dim_IntList in layers.0.attn (forward): add it to RECIPE_REDUCTIONS" \
        in lines[0]
    assert all(re.match(r"unlisted reduction: aten\.sum\.\S+ in layers\.0\.attn \((forward|backward)\)", line)
               for line in lines), lines


def test_what_counts_as_a_reduction():
    x, idx = torch.ones(4, 3), torch.tensor([0, 1, 0, 1])
    assert is_reduction(torch.ops.aten.sum.dim_IntList, (x, [0]), {})
    assert is_reduction(torch.ops.aten.mm.default, (x, x.t()), {})
    assert not is_reduction(torch.ops.aten.sum.dim_IntList, (idx, [0]), {})  # integer sums are exact
    assert not is_reduction(torch.ops.aten.amax.default, (x, [0]), {})  # exact: no grouping
    assert not is_reduction(torch.ops.aten.mul.Tensor, (x, x), {})
    assert is_reduction(torch.ops.aten.index_put.default, (x, [idx], x[0], True), {})
    assert not is_reduction(torch.ops.aten.index_put.default, (x, [idx], x[0]), {})
    assert is_reduction(torch.ops.c10d.allreduce_.default, (), {})


def test_a_row_covers_its_places_and_ops_only():
    row = next(e for e in RECIPE_REDUCTIONS if e.reduction.startswith("attention output"))
    assert row.covers("layers.3.attn.out", "aten.bmm.default")
    assert row.covers("mtp.0.block.ffn.down", "aten.sum.dim_IntList")
    assert not row.covers("layers.3.attn", "aten.bmm.default")
    assert not row.covers("layers.3.attn.out", "aten._softmax.default")
    assert reductions.NOT_SPLIT in {e.method for e in RECIPE_REDUCTIONS}
