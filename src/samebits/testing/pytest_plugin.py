"""The samebits pytest plugin (entry point ``pytest11: samebits``): byte tests in your test suite.

``@pytest.mark.bitwise(runs=3, threads=[1, 2])`` runs a test that returns (outputs, modules,
inputs) several times from the same RNG state and compares every output, gradient, parameter
and buffer bit for bit; ``samebits_golden`` checks digests against a file.  Options and usage:
docs/testing.md, "The pytest plugin".
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from samebits.errors import SamebitsError
from samebits.testing import _options
from samebits.testing._options import OPTIONS, add_to_pytest
from samebits.testing.coverage import check_coverage, render_coverage  # parses sources: no torch

# The plugin loads in every pytest run where samebits is installed: it imports torch only when a
# test uses its marker or fixture (the two function-level imports below); tests/test_testing.py.

_MARKER = ("bitwise(runs=None, threads=None, grads=True, contention=None, seed=0): run the test several "
           "times (at each thread count) and compare everything it returns, and the gradients, bit for bit")


class _Session:
    """What the plugin saw in one session, for the summary."""

    def __init__(self, config):
        self.config = config
        self.reports: list[tuple[str, object]] = []  # (test id, BitwiseReport)
        self.current: str | None = None
        self.golden_files: dict[Path, object] = {}  # path -> GoldenFile
        self.golden_checks = 0
        self.coverage = None

    def observe(self, report) -> None:
        self.reports.append((self.current or report.name, report))

    def option(self, name: str):
        return self.config.getoption(OPTIONS[name].dest)


_KEY = pytest.StashKey[_Session]()


def pytest_addoption(parser) -> None:
    add_to_pytest(parser.getgroup("samebits", "samebits byte tests"))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", _MARKER)
    session = config.stash[_KEY] = _Session(config)
    session.previous_defaults = dict(_options.SESSION_DEFAULTS)  # restored at unconfigure (nested runs)
    _options.SESSION_DEFAULTS.update(runs=session.option("runs"), contention=session.option("contention"))
    _options.observers.append(session.observe)


def pytest_unconfigure(config) -> None:
    session = config.stash.get(_KEY, None)
    if session is not None:
        _options.SESSION_DEFAULTS.update(session.previous_defaults)
        if session.observe in _options.observers:
            _options.observers.remove(session.observe)


def pytest_runtest_setup(item) -> None:
    item.config.stash[_KEY].current = item.nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    marker = pyfuncitem.get_closest_marker("bitwise")
    if marker is None:
        return None
    from samebits.testing import _harness  # torch: only in a session that byte-tests
    if marker.args:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: @pytest.mark.bitwise takes keywords only "
                                "(runs=, threads=, grads=, contention=, seed=)")
    options = dict(marker.kwargs)
    unknown = set(options) - {"runs", "threads", "grads", "contention", "seed"}
    if unknown:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: @pytest.mark.bitwise got unknown option(s) "
                                f"{sorted(unknown)}; it takes runs=, threads=, grads=, contention=, seed=")
    session = pyfuncitem.config.stash[_KEY]
    function = pyfuncitem.obj
    if inspect.iscoroutinefunction(function):
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: @pytest.mark.bitwise does not run async tests")
    arguments = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}

    def produce():
        result = function(**arguments)
        if result is None:
            raise AssertionError(
                f"{pyfuncitem.nodeid} is marked bitwise but returned nothing: return what to compare, "
                "e.g. `return layer(x), layer, x` (outputs; gradients of the module's parameters and of x)")
        return result, None

    runs = options.get("runs")
    try:
        report = _harness.repeat(
            produce, name=pyfuncitem.nodeid,
            runs=_harness._check_runs(session.option("runs") if runs is None else runs, 2, "@pytest.mark.bitwise"),
            grads=options.get("grads", True), threads=options.get("threads"),
            contention=session.option("contention") if options.get("contention") is None else options["contention"],
            seed=options.get("seed", 0))
    except SamebitsError as err:
        raise pytest.UsageError(f"{pyfuncitem.nodeid}: {err}") from None
    session.observe(report)
    if not report.ok:
        raise AssertionError(report.message())
    return True


@pytest.fixture
def samebits_golden(request):
    """Golden digests of this test's outputs and gradients, kept in
    ``__samebits__/<test file>.json`` next to the test: ``samebits_golden.check(fn, *inputs)``."""
    from samebits.testing._golden import Golden, GoldenFile, golden_path  # torch: only when used

    session = request.config.stash[_KEY]
    path = golden_path(request.node.path)
    file = session.golden_files.get(path) or session.golden_files.setdefault(path, GoldenFile(path))
    golden = Golden(file, request.node.nodeid.split("::", 1)[-1], update=session.option("update"))
    yield golden
    session.golden_checks += len(golden.keys)


def pytest_sessionfinish(session, exitstatus) -> None:
    state = session.config.stash.get(_KEY, None)
    if state is None:
        return
    if state.option("update"):
        state.written = [str(path) for path, file in state.golden_files.items() if file.save()]
    packages = state.option("coverage")
    if packages:
        try:
            state.coverage = check_coverage(packages, manifest=state.option("manifest"))
        except SamebitsError as err:
            state.coverage = err
        if isinstance(state.coverage, SamebitsError) or not state.coverage.ok:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    state = config.stash.get(_KEY, None)
    if state is None or not (state.reports or state.golden_checks or state.coverage is not None
                             or getattr(state, "written", None)):
        return
    write = terminalreporter.write_line
    terminalreporter.section("samebits")
    if state.reports:
        num_ok = sum(report.ok for _, report in state.reports)
        values = sum(len(report.paths) for _, report in state.reports)
        gradients = sum(report.num_gradients for _, report in state.reports)
        write(f"byte-tested: {len(state.reports)} check(s), {num_ok} bitwise repeatable, "
              f"{len(state.reports) - num_ok} not; {values} values compared ({gradients} gradients)")
        for test, report in state.reports:
            counts = sorted({run["threads"] for run in report.runs})
            load = " under contention" if any(run["contention"] for run in report.runs) else ""
            verdict = "equal" if report.ok else f"DIFFER in {len(report.differing_runs)} run(s)"
            write(f"  {test}: {len(report.runs)} runs at threads {counts}{load}, "
                  f"{len(report.paths)} values: {verdict}")
    if state.golden_checks:
        write(f"golden digests: {state.golden_checks} check(s)"
              + (" recorded (--samebits-update)" if state.option("update") else " compared"))
    for path in getattr(state, "written", None) or ():
        write(f"  wrote {path}: commit it")
    if state.coverage is not None:
        if isinstance(state.coverage, SamebitsError):
            write(f"kernel coverage: could not check: {state.coverage}")
        else:
            write(render_coverage(state.coverage))
