"""Tests for the empirical probe: samebits.probe / Probe and `samebits probe -- CMD`."""

from __future__ import annotations

import json
import random
import re
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import samebits
import samebits.determinism as det
from samebits.cli import main
from samebits.determinism._probe import (DEFAULT_COMPARISONS, MIN_COMPARISONS, NOT_COMPARED_UNINITIALISED,
                                         NOT_COMPARED_VIEW, _count_differences, miss_bound)

ROWS, N = 1000, 200_000


def _racy_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ROWS, (N,), generator=g), torch.randn(N, 64, generator=g)


def _probe(fn, comparisons=MIN_COMPARISONS):
    """A probe with few comparisons: these races show in nearly every execution."""
    with det.Probe(comparisons=comparisons) as active:
        result = fn()
    return active.report(result)


def _probe_until_found(fn, attempts=3):
    """The race needs both cores at once; retry so a busy machine cannot hide it."""
    for _ in range(attempts):
        report = _probe(fn)
        if report.findings:
            return report
    return report


# A stand-in for a race that shows in some executions only, without threads, so the tests
# are exact: every 4th execution gives other bits, or (RANDOM) each execution with chance
# `rate`.  Its namespace is not probed by default; the tests name it.
RACE_NS = "samebits_test_probe"
_race = {"executions": 0, "rate": None, "rng": random.Random(0)}


@torch.library.custom_op(f"{RACE_NS}::sometimes", mutates_args=())
def sometimes(x: torch.Tensor) -> torch.Tensor:
    _race["executions"] += 1
    if _race["rate"] is None:
        differs = _race["executions"] % 4 == 0
    else:
        differs = _race["rng"].random() < _race["rate"]
    return x + (1.0 if differs else 0.0)


@pytest.fixture(autouse=True)
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_probe_finds_index_put_accumulate():
    idx, values = _racy_inputs()

    def step():
        return torch.zeros(ROWS, 64).index_put_((idx,), values, accumulate=True)  # probe: here

    report = _probe_until_found(step)
    assert not report.clean
    (finding,) = report.findings
    assert finding.op == "aten::index_put_" and finding.module is None
    assert finding.call_site.endswith(f"{__file__}:{_line_of('probe: here')}")
    assert 0 < finding.elements_differing <= finding.numel == ROWS * 64
    assert "index_put_" in finding.known and report.result.shape == (ROWS, 64)
    assert json.loads(json.dumps(report.to_dict()))["findings"][0]["op"] == "aten::index_put_"


class Table(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(ROWS, 64))

    def forward(self, idx):
        return self.weight[idx]


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Table()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, idx, noise):
        return (self.proj(self.embed(idx)) * noise).sum()


def test_probe_finds_advanced_indexing_backward_with_module_scope():
    model = Model()
    idx, noise = _racy_inputs()

    def step():
        model.zero_grad()
        loss = model(idx, noise)
        loss.backward()  # probe: backward
        return loss

    report = _probe_until_found(step)
    ops = {(f.op, f.module) for f in report.findings}
    assert ("aten::index_put", "Model.embed (backward)") in ops, report.findings
    finding = next(f for f in report.findings if f.op == "aten::index_put")
    assert finding.call_site.endswith(f":{_line_of('probe: backward')}")
    assert finding.known and "index_add_" in finding.known


class Scatter(torch.nn.Module):
    def forward(self, idx, values):
        return torch.zeros(ROWS, 64).index_put_((idx,), values, accumulate=True)


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Identity(), Scatter()])
        self.weight = torch.nn.Parameter(torch.randn(ROWS, 64))

    def forward(self, idx, values):
        out = self.blocks[1](self.blocks[0](idx), values)
        # An op of Outer itself, after its submodules: its backward is Outer's.
        return out.sum() + (self.weight[idx] * values).sum()


def test_probe_module_scope_in_forward_and_backward():
    model = Outer()
    idx, values = _racy_inputs()
    outside = torch.randn(ROWS, 64, requires_grad=True)
    expected = {("aten::index_put_", "Outer.blocks.1"), ("aten::index_put", "Outer (backward)"),
                ("aten::index_put", "(backward)")}

    def step():
        model(idx, values).backward()
        (outside[idx] * values).sum().backward()  # not inside any module

    seen = set()
    for _ in range(3):  # each race needs both cores at once; retry on a busy machine
        seen |= {(f.op, f.module) for f in det.probe(step).findings}
        if expected <= seen:
            break
    assert expected <= seen, seen


def test_probe_reports_a_deterministic_step_clean_and_changes_nothing():
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Dropout(0.2),
                                    torch.nn.LayerNorm(64), torch.nn.Linear(64, 10))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    x, y = torch.randn(256, 32), torch.randint(0, 10, (256,))

    def step(model, optimizer):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    model, optimizer = make()
    expected_losses = [step(model, optimizer) for _ in range(2)]
    expected_next_random = torch.rand(3)
    expected_params = [p.detach().clone() for p in model.parameters()]

    model, optimizer = make()
    reports = [det.probe(step, model, optimizer) for _ in range(2)]
    assert all(r.clean for r in reports), [r.findings for r in reports]
    assert reports[0].num_ops_compared > 20
    assert reports[0].min_comparisons == DEFAULT_COMPARISONS and reports[0].num_signatures > 10
    # The program saw one execution: same losses, parameters and RNG stream as unprobed.
    assert all(torch.equal(r.result, e) for r, e in zip(reports, expected_losses))
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected_params))
    assert torch.equal(torch.rand(3), expected_next_random)


def test_racy_step_is_clean_under_deterministic_mode(monkeypatch):
    from samebits.determinism._environment import ENV_SETTINGS

    for setting in ENV_SETTINGS:
        monkeypatch.delenv(setting.name, raising=False)
    model = Model()
    idx, noise = _racy_inputs()
    with det.deterministic_mode(num_threads=2):
        report = _probe(lambda: model(idx, noise).backward(), comparisons=4)
    assert report.clean, report.findings


def test_in_place_and_out_ops_run_once_for_the_program():
    x = torch.zeros(5)
    out = torch.empty(5)
    with det.Probe() as probe:
        x.add_(1)
        torch.add(x, 1, out=out)
        view = x[1:3]
        view.mul_(10)
    assert x.tolist() == [1, 10, 10, 1, 1] and out.tolist() == [2.0] * 5
    assert probe.report().clean and probe.num_ops_compared >= 3


def test_comparison_is_bitwise_and_nan_safe():
    nan = torch.tensor([float("nan"), 1.0])
    assert _count_differences(nan, nan.clone()) == (0, 2)
    assert _count_differences(torch.tensor([0.0]), torch.tensor([-0.0])) == (1, 1)
    assert _count_differences((torch.ones(3, dtype=torch.bfloat16), 2.5),
                              (torch.ones(3, dtype=torch.bfloat16), 2.5)) == (0, 4)
    assert _count_differences(torch.ones(2), torch.ones(3))[0] > 0
    with det.Probe() as probe:
        torch.log(torch.tensor([-1.0, 0.0]))
        torch.complex(torch.ones(2), torch.zeros(2)) * 2
    assert probe.report().clean


def test_probe_as_context_manager_with_namespaces():
    idx, values = _racy_inputs()
    with det.Probe(namespaces=("prims",)) as probe:
        torch.zeros(ROWS, 64).index_put_((idx,), values, accumulate=True)
    report = probe.report()
    assert report.clean and report.num_ops_compared == 0 and report.num_ops > 0


def test_a_race_that_shows_in_a_quarter_of_executions_is_found_in_one_call():
    """The old probe ran each op twice: a race in every 4th execution passed as clean."""
    x = torch.ones(3)
    _race.update(executions=0, rate=None)
    with det.Probe(namespaces=("aten", RACE_NS)) as active:
        sometimes(x)  # one call, as in a probe of one step
    report = active.report()
    (finding,) = report.findings
    assert finding.op == f"{RACE_NS}::sometimes" and finding.calls == finding.calls_differing == 1
    # 11 executions, each compared with the first: the 4th and 8th differ.
    assert (finding.comparisons, finding.comparisons_differing) == (DEFAULT_COMPARISONS, 2)
    assert _race["executions"] == DEFAULT_COMPARISONS + 1
    assert report.to_dict()["findings"][0]["comparisons_differing"] == 2
    # Later calls of the same signature get one trial each (the target is met).
    _race.update(executions=0)
    with det.Probe(namespaces=("aten", RACE_NS), comparisons=3) as active:
        for _ in range(3):
            sometimes(x)
    assert _race["executions"] == 4 + 2 + 2


def test_the_bound_is_sound_and_stated():
    """(1-p)^C bounds the chance that C comparisons of a race in p of executions all agree."""
    bound = miss_bound(10)
    assert bound["missed_at_most"] == {"0.5": 0.5 ** 10, "0.25": 0.75 ** 10, "0.1": 0.9 ** 10}
    assert abs((1 - bound["found_95_at_rate"]) ** 10 - 0.05) < 1e-12
    assert "(1-p)^10" in bound["summary"] and "6% at p = 25%" in bound["summary"]
    assert "35% at p = 10%" in bound["summary"] and "0.098% at p = 50%" in bound["summary"]
    assert "at least 26% of executions is found with probability >= 95%" in bound["summary"]
    # The inequality it rests on: all n executions agree with probability sum P(x)^n
    # <= (1 - p)^(n-1), p = 1 - max P(x), for any distribution of results.
    rng = random.Random(1)
    for _ in range(200):
        weights = [rng.random() ** 3 for _ in range(rng.randint(2, 6))]
        probs = [w / sum(weights) for w in weights]
        p = 1 - max(probs)
        for n in (2, 3, 5, 11):
            assert sum(q ** n for q in probs) <= (1 - p) ** (n - 1) + 1e-12
    # And measured: a race in 30% of executions, probed 400 times with 4 comparisons each,
    # is missed at most (0.7)^4 = 24% of the time (exactly 0.7^5 + 0.3^5 = 17% expected).
    _race.update(rate=0.3, rng=random.Random(2))
    missed = 0
    try:
        for _ in range(400):
            with det.Probe(namespaces=(RACE_NS,), comparisons=4) as active:
                sometimes(torch.ones(1))
            report = active.report()
            missed += report.clean
            assert report.min_comparisons == 4 if report.clean else report.findings[0].comparisons == 4
    finally:
        _race.update(rate=None)
    assert 0.10 < missed / 400 <= (1 - 0.3) ** 4, missed


def test_the_ops_not_compared_are_listed_with_the_reason():
    x = torch.ones(4, 4)
    with det.Probe() as active:
        x.t()
        torch.empty(3)
        sometimes(x)  # a namespace not probed: runs once
        (x + 1).sum()
    report = active.report()
    reasons = {(entry.op, entry.reason) for entry in report.not_compared}
    assert ("aten::t", NOT_COMPARED_VIEW) in reasons
    assert ("aten::empty", NOT_COMPARED_UNINITIALISED) in reasons
    assert (f"{RACE_NS}::sometimes", f"namespace {RACE_NS} not probed (collectives, custom ops)") in reasons
    assert all(entry.op not in ("aten::add.Tensor", "aten::sum") for entry in report.not_compared)
    listed = report.to_dict()["not_compared"]
    assert {"op": f"{RACE_NS}::sometimes", "reason": f"namespace {RACE_NS} not probed (collectives, custom ops)",
            "calls": 1, "calls_compared": 0, "computes_nothing": False} in listed
    with pytest.raises(ValueError, match=r"comparisons=1.*at least 2"):
        det.Probe(comparisons=1)


def test_public_api():
    assert samebits.determinism.probe is det.probe
    assert samebits.check is det.check and not hasattr(det, "check_determinism")


def _line_of(marker: str) -> int:
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if f"# {marker}" in line:
                return number
    raise AssertionError(marker)


# --- samebits probe -- CMD (real subprocesses; a few seconds each) -----------------------

RACY_SCRIPT = textwrap.dedent("""
    import torch
    torch.set_num_threads(2)
    table = torch.nn.Parameter(torch.randn(1000, 64))
    optimizer = torch.optim.SGD([table], lr=0.1)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 1000, (200000,), generator=g)
    noise = torch.randn(200000, 64, generator=g)
    for step in range(50):
        optimizer.zero_grad()
        (table[idx] * noise).sum().backward()  # one call: the probe repeats it
        optimizer.step()
        print("finished step", step)
""")

# A race in every 4th execution (a custom op standing in for one), called once per step:
# one probe of one step must find it.
SOMETIMES_SCRIPT = textwrap.dedent(f"""
    import torch
    executions = 0

    @torch.library.custom_op("{RACE_NS}::sometimes", mutates_args=())
    def sometimes(x: torch.Tensor) -> torch.Tensor:
        global executions
        executions += 1
        return x + (1.0 if executions % 4 == 0 else 0.0)

    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        optimizer.zero_grad()
        out = model(torch.ones(2, 8))
        sometimes(out.detach())
        out.sum().backward()
        optimizer.step()
""")

CLEAN_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    print("done")
""")


def test_cli_probe_finds_ops_and_stops_after_steps(tmp_path, capsys):
    script = tmp_path / "racy.py"
    script.write_text(RACY_SCRIPT)
    code = main(["probe", "--json", "--stop-after", "0", "--comparisons", "2", "--", sys.executable, str(script)])
    captured = capsys.readouterr()
    assert code == 1, captured
    result = json.loads(captured.out)
    (process,) = result["processes"]
    assert process["steps"] == 1 and process["step_limit_reached"] and process["complete"]
    assert result["findings"] and result["findings"][0]["op"] == "aten::index_put"
    assert result["findings"][0]["call_site"].endswith("racy.py:11")
    assert {"op", "module", "call_site", "elements_differing"} <= set(result["findings"][0])


def test_cli_probe_clean_and_cannot_run(tmp_path, capfd):
    script = tmp_path / "clean.py"
    script.write_text(CLEAN_SCRIPT)
    assert main(["probe", "--", sys.executable, str(script)]) == 0
    out = capfd.readouterr().out  # fd-level: the command's own output too
    assert "done" in out and "clean" in out
    # The verdict states its bound, with figures that are (1-p)^10.
    assert "each op compared at least 10 times" in out and "<= (1-p)^10" in out
    for p in (0.5, 0.25, 0.1):  # (1-p)^9 would print 0.2%, 8%, 39%
        stated = float(re.search(rf"([0-9.]+)% at p = {p:.0%}", out).group(1))
        exact = 100 * (1 - p) ** 10  # 0.098%, 5.6%, 34.9%
        assert (stated == round(exact)) if exact >= 1 else abs(stated / exact - 1) < 0.01, (p, stated)
    assert re.search(r"at least 26% of executions is found with probability >= 95%", out)
    # The ops that ran once are listed: views and uninitialised outputs at least.
    assert "Not compared:" in out and "view: computes nothing" in out and "aten::t" in out
    # -I skips sitecustomize: the probe cannot start, which must not pass as clean.
    assert main(["probe", "--", sys.executable, "-I", "-c", "pass"]) == 2
    assert "did not start" in capfd.readouterr().err
    assert main(["probe", "--", "no-such-program-xyz"]) == 2
    # A program that runs no torch op gives no evidence: not clean (the old probe said clean).
    assert main(["probe", "--", sys.executable, "-c", "import torch"]) == 2
    assert "no op was compared" in capfd.readouterr().err
    assert main(["probe"]) == 2


def test_cli_probe_repeats_until_a_race_in_some_executions_shows(tmp_path, capsys):
    """The old probe compared each call once: this race (every 4th execution) passed as clean."""
    script = tmp_path / "sometimes.py"
    script.write_text(SOMETIMES_SCRIPT)
    command = ["--stop-after", "0", "--namespace", "aten", "--namespace", RACE_NS, "--", sys.executable, str(script)]
    code = main(["probe", "--json"] + command)
    captured = capsys.readouterr()
    assert code == 1, captured
    result = json.loads(captured.out)
    (finding,) = result["findings"]
    assert finding["op"] == f"{RACE_NS}::sometimes" and finding["call_site"].endswith("sometimes.py:16")
    assert (finding["comparisons"], finding["comparisons_differing"]) == (10, 2)
    # The bound covers the ops that never differed; the ops run once are listed.
    assert result["comparisons"] == 10 and result["bound"]["missed_at_most"]["0.25"] == 0.75 ** 10
    listed = {entry["op"]: entry for entry in result["not_compared"]}
    assert listed["aten::t"]["reason"] == "view: computes nothing" and listed["aten::t"]["computes_nothing"]
    assert listed["aten::t"]["calls"] >= 1 and listed["aten::t"]["calls_compared"] == 0
    # --comparisons sets the target; a run of an op compared once would not be a verdict.
    assert main(["probe", "--comparisons", "3"] + command) == 1
    out = capsys.readouterr().out
    assert "1/3" in out and "each op compared at least 3 times" in out and "(1-p)^3" in out
    with pytest.raises(SystemExit):
        main(["probe", "--comparisons", "1", "--", sys.executable, "-c", "pass"])
    assert "give an integer from 2" in capsys.readouterr().err


def test_cli_defaults_are_the_library_defaults():
    from samebits.cli import probe as cli_probe

    assert (cli_probe.DEFAULT_COMPARISONS, cli_probe.MIN_COMPARISONS) == (DEFAULT_COMPARISONS, MIN_COMPARISONS)
