"""Tests of samebits.testing and its pytest plugin: byte tests that fail on the racy CPU path
and pass on the deterministic one, the failure message, negative controls, golden digests,
the options shared with the CLI.

The racy path is `index_put_(accumulate=True)` with many indices colliding on a few rows and
more than 32768 elements: with 2 threads ATen splits the indices and sums colliding rows in
arrival order (measured here: a different result most calls).  Tests that need the race run
several times so that a busy machine cannot hide it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from samebits.cli import build_parser
from samebits.errors import ConfigError
from samebits.recipes import RecipeConfig, train
from samebits.recipes.model import MoE
from samebits.testing import (
    OPTIONS,
    Contention,
    assert_bitwise_repeatable,
    assert_same_bits,
    check_negative_control,
    expect_nondeterministic,
    index_put_accumulate_control,
)

pytest_plugins = ["pytester"]

RACE_RUNS = 8  # the race shows in most calls; 8 runs make a miss vanishingly rare
# Inner pytest runs (pytester): without the hypothesis plugin, whose summary re-imports
# hypothesis in every inner run (seconds each).
INNER = ("-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest")


def racy_failure(fn, *inputs, attempts=4, **options) -> str:
    """The message of a byte test that must fail on a racy path.  The race needs both cores at
    once; on a busy machine a few attempts keep a quiet spell from hiding it (test_probe.py
    does the same)."""
    for _ in range(attempts):
        try:
            assert_bitwise_repeatable(fn, *inputs, **options)
        except AssertionError as err:
            return str(err)
    pytest.fail(f"{attempts} x {options.get('runs')} runs of the racy path gave the same bits")


def gather_rows(weight, index):
    """Forward a gather (deterministic); backward accumulates with index_put_(accumulate=True)."""
    return weight[index]


def gather_rows_index_select(weight, index):
    return weight.index_select(0, index)  # backward: index_add_, deterministic


def racy_gather_inputs():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(8, 64, generator=gen), torch.randint(0, 8, (65536,), generator=gen)


# -- assert_bitwise_repeatable ------------------------------------------------------------

def test_deterministic_module_passes_across_thread_counts():
    layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    report = assert_bitwise_repeatable(layer, torch.randn(8, 32), runs=2, threads=[1, 2])
    assert report.ok and len(report.runs) == 4 and {run["threads"] for run in report.runs} == {1, 2}
    # outputs, 4 parameters, 4 parameter gradients and the input's gradient
    assert report.num_gradients == 5
    assert "grad of input[0]" in report.paths and any(p.endswith("0.weight") for p in report.paths)


def test_racy_forward_fails_and_the_message_localises_it():
    fn, inputs = index_put_accumulate_control()
    message = racy_failure(fn, *inputs, runs=RACE_RUNS, threads=2)
    assert "index_put_accumulate is not bitwise repeatable" in message
    assert f"runs differ from run 0 (threads=2)" in message
    assert "  output: " in message and "element(s) differ (torch.float32, shape [8, 64])" in message
    assert " ulp)" in message and "[0x" in message and "at (" in message
    assert "runs that disagree, per value: output:" in message


def test_racy_backward_is_named_as_the_input_gradient():
    weight, index = racy_gather_inputs()
    message = racy_failure(gather_rows, weight, index, runs=RACE_RUNS, threads=2)
    assert re.search(r"grad of input\[0\]: \d+ of 512 element", message), message
    # the same gather with a deterministic backward passes
    assert assert_bitwise_repeatable(gather_rows_index_select, weight, index, runs=3, threads=2).ok


def test_racy_backward_passes_with_one_thread():
    weight, index = racy_gather_inputs()
    assert assert_bitwise_repeatable(gather_rows, weight, index, runs=3, threads=1).ok


def test_contention_runs_a_background_load():
    with Contention() as load:
        assert_bitwise_repeatable(gather_rows_index_select, *racy_gather_inputs(), runs=2, threads=2)
    assert load.iterations > 0
    report = assert_bitwise_repeatable(torch.nn.Linear(8, 8), torch.randn(4, 8), runs=2, contention=True)
    assert all(run["contention"] for run in report.runs)


def test_every_run_starts_from_the_same_rng_state():
    dropout = torch.nn.Dropout(0.5)  # draws from the global generator: equal only if reseeded
    assert assert_bitwise_repeatable(dropout, torch.ones(64, 64), runs=3).ok


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="runs=1"):
        assert_bitwise_repeatable(torch.sin, torch.ones(2), runs=1)
    with pytest.raises(ConfigError, match=r"threads=\[0\]"):
        assert_bitwise_repeatable(torch.sin, torch.ones(2), threads=[0])


# -- negative controls --------------------------------------------------------------------

def test_shipped_negative_control_sees_the_index_put_race():
    report = check_negative_control(runs=20)
    assert not report.ok and report.mismatches[0].path == "output"


def test_negative_control_catches_a_harness_that_cannot_fail():
    # The same op with 1 thread cannot race: expect_nondeterministic must fail, and say why.
    fn, inputs = index_put_accumulate_control()
    with pytest.raises(AssertionError, match="1 thread only"):
        expect_nondeterministic(fn, *inputs, runs=3, threads=1)
    with pytest.raises(AssertionError, match="expected runs to differ"):
        expect_nondeterministic(gather_rows_index_select, *racy_gather_inputs(), runs=3, threads=2)


# -- assert_same_bits and the message -----------------------------------------------------

def test_same_bits_ignores_strides_but_not_dtype_or_shape():
    t = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    assert_same_bits(t.t(), t.t().contiguous())
    with pytest.raises(AssertionError, match="dtype torch.float32 vs torch.float64"):
        assert_same_bits(t, t.double())
    with pytest.raises(AssertionError, match=r"shape \[5, 3\] vs \[15\]"):
        assert_same_bits(t, t.reshape(-1))


def test_signed_zero_nan_payload_and_ulps_are_told_apart():
    nan = torch.tensor([float("nan")])
    other_nan = nan.view(torch.int32).add(1).view(torch.float32)
    a = {"loss": torch.tensor([0.0, 1.0, 2.0]), "nan": nan, "py": -0.0}
    b = {"loss": torch.tensor([-0.0, 1.0, 2.0]).index_put_((torch.tensor([2]),), torch.tensor([2.0000005])),
         "nan": other_nan, "py": 0.0}
    with pytest.raises(AssertionError) as caught:
        assert_same_bits(a, b, names=("before", "after"))
    message = str(caught.value)
    assert "value['loss']: 2 of 3 element(s) differ" in message
    assert "at (0,): 0.0 [0x00000000] vs -0.0 [0x80000000] (signed zeros: +0 and -0)" in message
    assert "(2 ulp)" in message  # 2.0000005 is 2 floats above 2.0
    assert "value['nan']" in message and "(both NaN: different payloads)" in message
    assert "value['py']: -0.0 [0x" in message  # Python floats by their bits
    assert_same_bits(nan, nan.clone())  # the same NaN bits are equal


def test_nested_structures_name_missing_and_extra_values():
    with pytest.raises(AssertionError, match=r"value\['b'\]: present in the first, missing in the second"):
        assert_same_bits({"a": torch.ones(1), "b": torch.ones(1)}, {"a": torch.ones(1)})
    with pytest.raises(AssertionError, match=r"value\[1\]\[0\]"):
        assert_same_bits([torch.ones(2), (torch.ones(2, dtype=torch.bfloat16),)],
                         [torch.ones(2), (torch.zeros(2, dtype=torch.bfloat16),)])


def test_message_counts_how_many_runs_disagreed():
    calls = []

    def flaky(x):  # the second and third of four runs differ in one element
        calls.append(1)
        out = x * 2
        if len(calls) in (2, 3):
            out = out.clone()
            out.view(-1)[5] = torch.nextafter(out.view(-1)[5], torch.tensor(10.0))
        return out

    with pytest.raises(AssertionError) as caught:
        assert_bitwise_repeatable(flaky, torch.ones(3, 4), runs=4, grads=False)
    message = str(caught.value)
    assert "2 of 3 runs differ from run 0" in message and "first differing run: 1" in message
    assert "at (1, 1): 2.0 [0x40000000] vs 2.000000238418579 [0x40000001] (1 ulp)" in message
    assert "output: 2 run(s)" in message


# -- the module test of the issue: one decorator on a user's test -------------------------

MODULE_TEST = """
import pytest, torch
from samebits.recipes import RecipeConfig, train
from samebits.recipes.model import MoE

@pytest.mark.bitwise(runs=5, threads=2)
@pytest.mark.parametrize("combine", ["index_add", "index_put_accumulate"])
def test_moe_layer(combine):
    # top-4 routing: each token's gradient sums 4 rows (2 terms add the same either way round)
    moe = MoE(RecipeConfig(moe_combine=combine, moe_top_k=4, num_threads=2))
    for param in moe.parameters():                   # the recipe's Transformer inits these; alone they are empty
        torch.nn.init.normal_(param, std=0.1)
    x = torch.randn(4, 64, 64, requires_grad=True)   # 256 tokens x 4: the racy path crosses ATen's grain size
    out, aux_loss = moe(x)
    return out, aux_loss, moe, x                     # outputs; gradients of the experts, router and x
"""


def test_marker_passes_the_deterministic_module_and_fails_the_racy_one(pytester):
    pytester.makepyfile(test_moe=MODULE_TEST)
    result = pytester.runpytest_inprocess(*INNER)
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    assert "test_moe_layer[index_put_accumulate]" in output and "is not bitwise repeatable" in output
    # localised to a value with element detail; which of them races (the combine's forward
    # output, or a gradient only) varies from run to run, so none is named here
    assert re.search(r"(output\[\d+\]|grad of [^:\n]+): \d+ of \d+ element\(s\) differ", output), output
    assert "byte-tested: 2 check(s), 1 bitwise repeatable, 1 not" in output
    assert "test_moe_layer[index_add]: 5 runs at threads [2]" in output


def test_marker_options_and_misuse(pytester):
    pytester.makepyfile(test_marked="""
        import pytest, torch

        @pytest.mark.bitwise()
        def test_linear():
            layer = torch.nn.Linear(4, 4)
            return layer(torch.ones(2, 4)), layer

        @pytest.mark.bitwise(runs=2)
        def test_returns_nothing():
            torch.ones(1)
    """)
    result = pytester.runpytest_inprocess(*INNER, "--samebits-runs", "5")
    result.assert_outcomes(passed=1, failed=1)
    output = result.stdout.str()
    assert "test_linear: 5 runs" in output  # --samebits-runs sets the default
    assert "marked bitwise but returned nothing" in output
    bad = pytester.runpytest_inprocess(*INNER, "--samebits-runs", "1")
    assert bad.ret != 0 and "--samebits-runs=1: a repeatability check needs at least 2 runs" in bad.stderr.str()


def test_contention_option_reaches_the_marker(pytester):
    pytester.makepyfile(test_load="""
        import pytest, torch

        @pytest.mark.bitwise(runs=2)
        def test_linear():
            return torch.nn.Linear(4, 4)(torch.ones(2, 4))
    """)
    result = pytester.runpytest_inprocess(*INNER, "--samebits-contention")
    result.assert_outcomes(passed=1)
    assert "test_linear: 2 runs at threads" in result.stdout.str() and "under contention" in result.stdout.str()


# -- golden digests ----------------------------------------------------------------------

GOLDEN_TEST = """
import torch

SCALE = {scale}

def layer(x):
    return torch.tanh(x * SCALE)

def test_layer(samebits_golden):
    x = torch.linspace(-2, 2, 64).reshape(8, 8)
    samebits_golden.check(layer, x)
"""


def test_golden_digests_missing_recorded_and_changed(pytester):
    pytester.makepyfile(test_golden=GOLDEN_TEST.format(scale="1.5"))
    missing = pytester.runpytest_inprocess(*INNER)
    missing.assert_outcomes(failed=1)
    assert "no golden digests for test_layer" in missing.stdout.str()
    assert "run with --samebits-update and commit" in missing.stdout.str()

    recorded = pytester.runpytest_inprocess(*INNER, "--samebits-update")
    recorded.assert_outcomes(passed=1)
    path = pytester.path / "__samebits__" / "test_golden.py.json"
    assert "wrote" in recorded.stdout.str() and path.exists()
    data = json.loads(path.read_text())
    assert set(data["tests"]["test_layer"]["result"]) == {"output", "grad of input[0]"}
    assert data["recorded_with"]["torch"] == torch.__version__

    pytester.runpytest_inprocess(*INNER).assert_outcomes(passed=1)

    pytester.makepyfile(test_golden=GOLDEN_TEST.format(scale=repr(struct.unpack("<f", struct.pack("<f", 1.5))[0] + 2**-20)))
    changed = pytester.runpytest_inprocess(*INNER)
    changed.assert_outcomes(failed=1)
    out = changed.stdout.str()
    assert "outputs changed: intended? rerun with --samebits-update and commit the new file" in out
    assert "output: float32 [8, 8]" in out and "grad of input[0]: float32 [8, 8]" in out


def test_golden_file_of_another_digest_version_is_refused_until_re_recorded(pytester):
    """A golden file written before digest version 2 (no digest_version field) holds digests of
    another function: checking it must stop with how to re-record, never report a change."""
    pytester.makepyfile(test_golden=GOLDEN_TEST.format(scale="1.5"))
    pytester.runpytest_inprocess(*INNER, "--samebits-update").assert_outcomes(passed=1)
    path = pytester.path / "__samebits__" / "test_golden.py.json"
    data = json.loads(path.read_text())
    assert data["digest_version"] == 2
    del data["digest_version"]  # how a file recorded with digest version 1 looks
    path.write_text(json.dumps(data))
    old = pytester.runpytest_inprocess(*INNER)
    old.assert_outcomes(failed=1)
    out = old.stdout.str()
    assert "recorded with digest version 1" in out and "--samebits-update" in out
    assert "outputs changed" not in out
    pytester.runpytest_inprocess(*INNER, "--samebits-update").assert_outcomes(passed=1)
    assert json.loads(path.read_text())["digest_version"] == 2
    pytester.runpytest_inprocess(*INNER).assert_outcomes(passed=1)


# -- the plugin loads in every pytest session of the environment ---------------------------

def plugin_imports(pythonpath: str | None = None) -> list[str]:
    """The heavy modules that importing the pytest plugin loads, in a fresh interpreter."""
    code = ("import sys, samebits.testing.pytest_plugin; "
            "print(','.join(m for m in ('torch', 'numpy') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return [name for name in out.stdout.strip().split(",") if name]


def test_the_plugin_imports_no_torch_until_a_test_uses_it(tmp_path):
    """pytest loads the plugin in every session of an environment where samebits is installed:
    loading it must not import torch (the reason its two byte-test imports sit in functions,
    the only samebits imports tests/test_architecture.py allows there besides Triton's)."""
    assert plugin_imports() == []
    # The check can fail: a copy of the package whose plugin imports a heavy module at the top
    # (numpy, which the harness imports too: the same failure as torch, seconds cheaper).
    package = Path(__file__).resolve().parent.parent / "src" / "samebits"
    shutil.copytree(package, tmp_path / "samebits", ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    plugin = tmp_path / "samebits" / "testing" / "pytest_plugin.py"
    plugin.write_text(plugin.read_text().replace("import pytest\n", "import numpy\nimport pytest\n", 1))
    assert plugin_imports(str(tmp_path)) == ["numpy"]


# -- options shared with the CLI ----------------------------------------------------------

def test_options_are_defined_once_for_the_plugin_and_the_cli():
    parser = build_parser()
    coverage = parser._subparsers._group_actions[0].choices["coverage"]
    flags = {action.option_strings[0]: action for action in coverage._actions if action.option_strings}
    for name in ("update", "manifest"):
        assert flags[OPTIONS[name].cli_flag].help == OPTIONS[name].help
    with pytest.raises(ConfigError, match="--samebits-runs='x' must be an integer"):
        OPTIONS["runs"].parse("x", "--samebits-runs")


@pytest.mark.slow
@pytest.mark.bitwise(runs=2)
def test_recipe_training_is_bitwise_repeatable(monkeypatch):
    """The recipe layer: two steps of training, every parameter and loss compared bit for bit."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # deterministic mode pins it
    result = train(RecipeConfig(num_threads=2), steps=2)
    return result.params, [m["loss"] for m in result.metrics]


def test_moe_module_byte_test_in_process():
    """The recipe-layer module check without the plugin: the deterministic combine passes."""
    def build_and_run(x):
        moe = MoE(RecipeConfig(moe_combine="index_add", num_threads=2))
        for param in moe.parameters():  # torch.empty until the recipe's init_weights: init here
            torch.nn.init.normal_(param, std=0.1)
        out, aux = moe(x)
        return out, aux, moe

    assert assert_bitwise_repeatable(build_and_run, torch.randn(2, 64, 64), runs=2, threads=2).ok


def test_docs_example_runs():
    """docs/testing.md's first example, as written."""
    code = textwrap.dedent("""
        import torch
        from samebits.testing import assert_bitwise_repeatable
        layer = torch.nn.Linear(64, 64)
        assert_bitwise_repeatable(layer, torch.randn(8, 64), runs=3, threads=[1, 2])
    """)
    exec(compile(code, "docs/testing.md", "exec"), {})
