"""Byte tests for your own kernels and modules: repeatability, golden digests, negative controls.

    from samebits.testing import assert_bitwise_repeatable, assert_same_bits, expect_nondeterministic

    assert_bitwise_repeatable(my_layer, x, runs=3, threads=[1, 2])   # outputs and gradients, bit for bit
    assert_same_bits(fused(x), reference(x))                           # two structures of tensors
    expect_nondeterministic(racy_fn, x, threads=2)                     # a negative control must differ

The pytest plugin (registered as ``samebits``) adds ``@pytest.mark.bitwise(runs=, threads=)``,
the ``samebits_golden`` fixture and ``--samebits-update`` / ``--samebits-contention`` /
``--samebits-runs`` / ``--samebits-coverage``; `samebits.testing.coverage` checks that every
kernel of a package has a byte test.  See docs/testing.md.
"""

from samebits.testing._bits import Mismatch
from samebits.testing._golden import Golden, GoldenFile, golden_path
from samebits.testing._harness import (
    BitwiseReport,
    Contention,
    assert_bitwise_repeatable,
    assert_same_bits,
    check_negative_control,
    expect_nondeterministic,
    index_put_accumulate_control,
)
from samebits.testing._options import OPTIONS, Option

__all__ = [
    "assert_bitwise_repeatable",
    "assert_same_bits",
    "expect_nondeterministic",
    "index_put_accumulate_control",
    "check_negative_control",
    "BitwiseReport",
    "Mismatch",
    "Contention",
    "Golden",
    "GoldenFile",
    "golden_path",
    "OPTIONS",
    "Option",
]
