"""Byte tests for your own kernels and modules: repeatability (`assert_bitwise_repeatable`),
`assert_same_bits`, negative controls (`expect_nondeterministic`), golden digests; the pytest
plugin and `samebits.testing.coverage` build on them.  See docs/testing.md.
"""

from __future__ import annotations

from samebits._lazy_exports import lazy_exports

# Public name -> the module defining it.  Loaded on first access (PEP 562): the pytest plugin
# imports this package in every pytest run, and the harness imports torch.
_EXPORTS = {
    "assert_bitwise_repeatable": "_harness", "assert_same_bits": "_harness", "expect_nondeterministic": "_harness",
    "index_put_accumulate_control": "_harness", "check_negative_control": "_harness", "BitwiseReport": "_harness",
    "Contention": "_harness", "Mismatch": "_bits", "Golden": "_golden", "GoldenFile": "_golden",
    "golden_path": "_golden", "OPTIONS": "_options", "Option": "_options", "add_to_argparse": "_options",
}

__all__ = list(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
