"""Tests for the empirical probe: samebits.probe / Probe and `samebits probe -- CMD`."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import samebits
import samebits.determinism as det
from samebits.cli import main
from samebits.determinism._probe import _count_differences

ROWS, N = 1000, 200_000


def _racy_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ROWS, (N,), generator=g), torch.randn(N, 64, generator=g)


def _probe_until_found(fn, attempts=3):
    """The race needs both cores at once; retry so a busy machine cannot hide it."""
    for _ in range(attempts):
        report = det.probe(fn)
        if report.findings:
            return report
    return report


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
        report = det.probe(lambda: model(idx, noise).backward())
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


def test_public_api():
    assert samebits.determinism.probe is det.probe
    assert det.check_determinism is det.check


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
        for _ in range(3):  # three chances for the race, should the machine be busy
            (table[idx] * noise).sum().backward()
        optimizer.step()
        print("finished step", step)
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
    code = main(["probe", "--json", "--steps", "1", "--", sys.executable, str(script)])
    captured = capsys.readouterr()
    assert code == 1, captured
    result = json.loads(captured.out)
    (process,) = result["processes"]
    assert process["steps"] == 1 and process["step_limit_reached"] and process["complete"]
    assert result["findings"] and result["findings"][0]["op"] == "aten::index_put"
    assert result["findings"][0]["call_site"].endswith("racy.py:12")
    assert {"op", "module", "call_site", "elements_differing"} <= set(result["findings"][0])


def test_cli_probe_clean_and_cannot_run(tmp_path, capfd):
    script = tmp_path / "clean.py"
    script.write_text(CLEAN_SCRIPT)
    assert main(["probe", "--", sys.executable, str(script)]) == 0
    out = capfd.readouterr().out  # fd-level: the command's own output too
    assert "done" in out and "clean" in out
    # -I skips sitecustomize: the probe cannot start, which must not pass as clean.
    assert main(["probe", "--", sys.executable, "-I", "-c", "pass"]) == 2
    assert "did not start" in capfd.readouterr().err
    assert main(["probe", "--", "no-such-program-xyz"]) == 2
    assert main(["probe"]) == 2
