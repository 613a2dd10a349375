"""Tests of kernel coverage (`samebits coverage`, `samebits.testing.coverage`, `--samebits-coverage`).

Our own kernels pass against src/samebits/kernels/kernel-coverage.toml (the CI check).  A
planted package shows every failure: a kernel without a test, a kernel changed without its
test changing (and `--update` refusing to record that), a missing test, a gone kernel.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from samebits.cli import main
from samebits.errors import ConfigError
from samebits.testing.coverage import check_coverage, find_kernels, render_coverage
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK

pytest_plugins = ["pytester"]

KERNELS = '''
import torch
import triton
import triton.language as tl
from triton import jit as tjit


@triton.jit
def scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


@tjit
def helper(x):
    return x + 1


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


@torch.library.custom_op("planted::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


torch.library.define("planted::triple", "(Tensor x) -> Tensor")


def not_a_kernel(x):
    return x


if torch.cuda.is_available() or True:   # kernels defined under a condition are found too
    @triton.jit
    def guarded_kernel(x):
        return x
'''

TESTS = '''
import pytest

@pytest.mark.bitwise
def test_scale():
    return 1

def test_ops():
    assert True
'''

MANIFEST = '''
[manifest]
root = ".."

[[kernel]]
name = "planted/ops.py::scale_kernel"
kind = "triton"
tests = ["tests/test_ops.py::test_scale"]

[[kernel]]
name = "planted/ops.py::helper"
kind = "triton"
tests = ["tests/test_ops.py::test_scale"]

[[kernel]]
name = "planted/ops.py::Scale"
kind = "autograd"
tests = ["tests/test_ops.py::test_scale", "tests/test_ops.py::test_ops"]

[[kernel]]
name = "planted/ops.py::planted::double"
kind = "custom_op"
tests = ["tests/test_ops.py::test_ops"]

[[kernel]]
name = "planted/ops.py::guarded_kernel"
kind = "triton"
tests = ["tests/test_ops.py::test_scale"]

[[kernel]]
name = "planted/ops.py::planted::triple"
kind = "custom_op"
tests = ["tests/test_ops.py::test_ops[param]"]
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "ops.py").write_text(KERNELS)
    (package / "kernel-coverage.toml").write_text(MANIFEST)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ops.py").write_text(TESTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def statuses(result):
    return {row.name.split("::", 1)[1]: row.status for row in result.rows}


def test_our_own_kernels_are_covered(capsys):
    """The CI check: every Triton kernel and autograd Function of samebits.kernels has a
    recorded byte test whose hashes match."""
    assert main(["coverage", "samebits.kernels"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "kernel coverage of samebits.kernels: PASS: 16 of 16" in out  # the recipe's entries: not in scope
    assert main(["coverage", "samebits"]) == EXIT_OK  # the recipe's autograd Functions too
    assert "kernel coverage of samebits: PASS: 26 of 26" in capsys.readouterr().out
    assert main(["coverage", "--json"]) == EXIT_OK  # the default package is ours
    data = json.loads(capsys.readouterr().out)
    kinds = {row["kind"] for row in data["kernels"]}
    assert data["verdict"] == "pass" and kinds == {"triton", "autograd"}


def test_finds_every_kind_of_kernel_without_importing(planted):
    found = {k.name.split("::", 1)[1]: k.kind for k in find_kernels(planted / "planted", planted)}
    assert found == {"scale_kernel": "triton", "helper": "triton", "Scale": "autograd", "guarded_kernel": "triton",
                     "planted::double": "custom_op", "planted::triple": "custom_op"}


def test_update_records_then_check_passes(planted, capsys):
    before = check_coverage(["planted"])
    assert set(statuses(before).values()) == {"not recorded"} and before.verdict.exit_code == EXIT_BAD_VERDICT
    assert main(["coverage", "planted", "--update"]) == EXIT_OK
    assert "recorded new hashes for planted/ops.py::Scale" in capsys.readouterr().out
    result = check_coverage(["planted"])
    assert result.ok and len(result.rows) == 6


def test_unregistered_kernel_fails(planted, capsys):
    check_coverage(["planted"], update=True)
    ops = planted / "planted" / "ops.py"
    ops.write_text(ops.read_text() + "\n\n@triton.jit\ndef new_kernel(x):\n    return x\n")
    assert main(["coverage", "planted"]) == EXIT_BAD_VERDICT
    out = capsys.readouterr().out
    assert "FAIL triton    planted/ops.py::new_kernel: no test:" in out and "ops.py:" in out


def test_kernel_changed_without_its_test_changing_fails_and_update_refuses(planted):
    check_coverage(["planted"], update=True)
    ops = planted / "planted" / "ops.py"
    ops.write_text(ops.read_text().replace("return x * 2\n\n    @staticmethod", "return x * 3\n\n    @staticmethod"))
    result = check_coverage(["planted"])
    assert statuses(result)["Scale"] == "changed without its test" and not result.ok
    assert "extend the byte test" in render_coverage(result)
    assert not check_coverage(["planted"], update=True).ok  # --update does not launder the change
    tests = planted / "tests" / "test_ops.py"  # the test changes with it: now --update records
    tests.write_text(tests.read_text().replace("return 1", "return 3"))
    assert statuses(check_coverage(["planted"]))["Scale"] == "not recorded"
    assert check_coverage(["planted"], update=True).ok and check_coverage(["planted"]).ok


def test_missing_test_and_gone_kernel_fail(planted):
    check_coverage(["planted"], update=True)
    manifest = planted / "planted" / "kernel-coverage.toml"
    manifest.write_text(manifest.read_text().replace("tests/test_ops.py::test_ops\"]", "tests/test_ops.py::test_gone\"]")
                        + '\n[[kernel]]\nname = "planted/ops.py::removed"\nkind = "triton"\ntests = []\n')
    result = statuses(check_coverage(["planted"]))
    assert result["planted::double"] == "test missing" and result["removed"] == "gone"
    # an entry outside the package checked is another package's: neither judged nor gone
    manifest.write_text(manifest.read_text() + '\n[[kernel]]\nname = "elsewhere/ops.py::other"\nkind = "triton"\ntests = []\n')
    assert "other" not in statuses(check_coverage(["planted"]))


def test_bad_inputs_exit_2(planted, tmp_path, capsys):
    assert main(["coverage", "no_such_package_here"]) == EXIT_CANNOT_RUN
    assert "not an importable package" in capsys.readouterr().err
    (planted / "planted" / "kernel-coverage.toml").unlink()
    assert main(["coverage", "planted"]) == EXIT_CANNOT_RUN
    assert "no kernel-coverage.toml inside" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('[[kernel]]\nname = "x"\nkind = "cuda"\ntests = []\n')
    with pytest.raises(ConfigError, match="kind"):
        check_coverage(["planted"], manifest=bad)


def test_nothing_to_check_is_incomplete(planted):
    (planted / "planted" / "ops.py").write_text("x = 1\n")
    (planted / "planted" / "kernel-coverage.toml").write_text("[manifest]\nroot = \"..\"\n")
    assert check_coverage(["planted"]).verdict.exit_code == EXIT_CANNOT_RUN


def test_pytest_option_fails_the_session(planted, pytester):
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    args = ("-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "--samebits-coverage", "planted")
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == 1 and "kernel coverage of planted: FAIL" in result.stdout.str()
    check_coverage(["planted"], update=True)
    result = pytester.runpytest_inprocess(*args)
    assert result.ret == 0 and "kernel coverage of planted: PASS: 6 of 6" in result.stdout.str()
