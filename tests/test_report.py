"""`samebits report`: the page built from real runs, checked in a real headless browser.

The inputs are real: runs written by `Recorder` with a difference planted at a known rank and
step, a real `samebits verify` of a small script whose resume forgets the RNG state, and the
summaries `samebits bisect` and `samebits matrix` write, made by their own result objects
(`BisectResult.to_dict`, `MatrixResult.to_dict`) over real streams and a real element
comparison.  The page is opened in Chromium (`--dump-dom` for the rendered DOM, a screenshot
kept under tests/artefacts/); without Chromium these tests fail in CI and skip loudly elsewhere.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch

import samebits
from samebits.autorecord import STOPPED_MARKER
from samebits.cli import main
from samebits.cli.bisect import render as render_bisect
from samebits.cli.diff import render as render_diff
from samebits.cli.matrix import render as render_matrix
from samebits.cli.verify import render as render_verify
from samebits.compare import DiffResult
from samebits.runners.bisect import BisectResult, Elements, Origin, Stage
from samebits.runners.matrix import CellResult, MatrixResult
from samebits.runners.conclusion import bisect_conclusion, conclusion, verify_conclusion
from samebits.runners.report import build_report, differing_records
from samebits.runners.program import ZeroCode
from samebits.runners.verify import VerifyResult, verify
from samebits.trace import compare_elements
from samebits.verdicts import EXIT_BAD_VERDICT, EXIT_CANNOT_RUN, EXIT_OK, Verdict

HOSTILE = '<img src=x onerror=alert(1)></script><script>alert(2)</script>"\'\x1b[31m'
HOSTILE_SHOWN = HOSTILE.replace("\x1b", "\\x1b")  # as text: the escape character made visible
ARTEFACTS = Path(__file__).parent / "artefacts"
NUM_STEPS = 8
PLANTED = {0: 5, 1: 3}  # rank -> first step whose bits differ in run b


def write_runs(root: Path, *, plant: bool = True, config_b: dict | None = None) -> tuple[Path, Path]:
    """Two 2-rank runs; in b, rank r's first weight element moves one ulp from step PLANTED[r] on."""
    paths = []
    for label in ("a", "b"):
        for rank in range(2):
            config = {"lr": 0.1, "label": HOSTILE}
            if label == "b" and config_b:
                config.update(config_b)
            rec = samebits.Recorder(root / label, rank=rank, world_size=2, config=config)
            weight = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
            for step in range(NUM_STEPS):
                weight = weight * 0.9 + 0.01
                if label == "b" and plant and step >= PLANTED[rank]:
                    weight = weight.clone()
                    weight[0, 0] = torch.nextafter(weight[0, 0], torch.tensor(10.0))
                rec.metrics(step, loss=weight.sum(), lr=0.1)
                rec.tensors(step, "params", [("layer.weight", weight), (HOSTILE, weight * 2), ("bias", torch.ones(3))])
            rec.close()
        paths.append(root / label)
    return paths[0], paths[1]


# -- the browser -------------------------------------------------------------------------------


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if found is None:
        message = ("no Chromium on this machine: the HTML report's browser checks did NOT run "
                   "(install it: apt-get install chromium)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message + "; CI must install it.")
        pytest.skip("LOUD SKIP: " + message)
    return found


def _browser(page: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            f"--user-data-dir={tmp_path / 'chromium-profile'}", *extra, page.resolve().as_uri()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def rendered_dom(page: Path, tmp_path: Path) -> "Dom":
    return Dom(_browser(page, tmp_path, "--dump-dom").stdout)


def screenshot(page: Path, tmp_path: Path, name: str, height: int = 2000) -> Path:
    ARTEFACTS.mkdir(exist_ok=True)
    shot = ARTEFACTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    _browser(page, tmp_path, f"--screenshot={shot}", f"--window-size=1200,{height}")
    assert shot.is_file() and shot.stat().st_size > 10_000, "the screenshot is missing or blank"
    print(f"screenshot of the report: {shot}")
    return shot


class Dom(HTMLParser):
    """The elements and text of a page, as the browser serialised them."""

    def __init__(self, markup: str):
        super().__init__(convert_charrefs=True)
        self.markup = markup
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self._open: list[str] = []
        self.headings: list[str] = []
        self._heading: list[str] | None = None
        self.feed(markup)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag in ("h1", "h2"):
            self._heading = []

    def handle_endtag(self, tag):
        if tag in ("h1", "h2") and self._heading is not None:
            self.headings.append("".join(self._heading))
            self._heading = None

    def handle_data(self, data):
        self.text.append(data)
        if self._heading is not None:
            self._heading.append(data)

    def all_text(self) -> str:
        return "".join(self.text)

    def cells(self, css: str) -> list[str]:
        """The titles of the heatmap cells of one class."""
        return [attrs.get("title", "") for tag, attrs in self.tags if tag == "td" and attrs.get("class") == css]


def assert_self_contained(markup: str) -> None:
    assert re.search(r"<script[\s>]", markup, re.I) is None, "the page holds a script element"
    assert re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", markup, re.I) is None, "the page loads from the network"
    assert "Content-Security-Policy" in markup and "default-src 'none'" in markup


def assert_nothing_injected(dom: Dom) -> None:
    tags = {tag for tag, _ in dom.tags}
    assert "img" not in tags and "script" not in tags, f"an element was injected: {sorted(tags)}"
    assert not any(name.startswith("on") for _, attrs in dom.tags for name in attrs), "an event handler was injected"


# -- two run directories -----------------------------------------------------------------------


def test_two_runs_in_a_browser_divergence_localised_and_hostile_names_shown_as_text(tmp_path, capsys):
    a, b = write_runs(tmp_path, config_b={"lr": 0.2})
    page = tmp_path / "report.html"
    code = main(["report", str(a), str(b), "-o", str(page), "--allow-config-diff"])
    out, err = capsys.readouterr()
    assert code == EXIT_BAD_VERDICT, out + err
    assert "DIVERGED" in out and "rank 0: step 5, rank 1: step 3" in out
    assert "DIVERGED at step 3, rank 1: params/layer.weight" in out.splitlines()  # the page's first sentence
    assert re.search(r"\[\s*\d+\.\ds\] \[1/1\] comparing", err), err  # progress: elapsed time and counter
    markup = page.read_text(encoding="utf-8")
    assert_self_contained(markup)

    dom = rendered_dom(page, tmp_path)
    assert_nothing_injected(dom)
    text = dom.all_text()
    assert HOSTILE_SHOWN in text  # the tensor name and the config value, as text
    assert dom.headings[0].startswith("samebits diff")
    for section in ("ulp growth", "metric curves", "where the runs differ, step by step",
                    "records that differ, by module, step by step", "environment and config"):
        assert any(section in heading for heading in dom.headings), (section, dom.headings)
    verdicts = [attrs for tag, attrs in dom.tags if attrs.get("id") == "verdict"]
    assert verdicts and "DIVERGED" in text
    # the heatmap of one or two ranks: record groups x steps, each rank's own first divergent step
    # marked where its records differ, identical before it, every later differing step shown
    first = dom.cells("h-first")
    assert sorted(first) == ["rank 0: loss, step 5: first divergence: 1 of 1 record(s) differ, 4 ulp",
                             "rank 0: params, step 5: first divergence: 2 of 3 record(s) differ (digests: values not "
                             "recorded)",  # rank 1's loss keeps its bits at step 3: only its params differ there
                             "rank 1: params, step 3: first divergence: 2 of 3 record(s) differ (digests: values not "
                             "recorded)"], first
    assert "rank 1: params, step 2: identical (3 record(s))" in dom.cells("h-same")
    assert "rank 1: lr, step 6: identical (1 record(s))" in dom.cells("h-same")  # lr never differs
    assert len([c for c in dom.cells("h-differs") if c.startswith("rank 0: params")]) == NUM_STEPS - 1 - PLANTED[0]
    # per-record table: the tensors are digests only (said, no number invented); the loss has its ulps
    assert "digests only: values not recorded" in text
    assert re.search(r'title="1 ulp, rel \d\.\d\de-0\d">1 ulp<', dom.markup), "the loss's exact distance is missing"
    # the environment section names the allowed config difference
    assert "config.lr" in text and "0.1" in text and "0.2" in text
    screenshot(page, tmp_path, "report-two-runs")


def test_identical_runs_are_identical_and_an_empty_window_is_never(tmp_path):
    a, b = write_runs(tmp_path, plant=False)
    report = build_report([a, b])
    assert report.verdict is Verdict.IDENTICAL and report.pairs[0].first_by_rank == {}
    assert '<td class="h-first"' not in report.html and '<td class="h-same"' in report.html
    assert 'id="per-tensor"' not in report.html and 'id="ulp-plot"' not in report.html  # nothing differs
    assert report.conclusion.startswith("IDENTICAL: bit for bit. 2 rank(s) x 8 step(s)")
    # a window past the last step compared nothing: never IDENTICAL
    empty = build_report([a, b], start_step=NUM_STEPS + 3)
    assert empty.verdict is Verdict.INCOMPLETE and "nothing to compare" in empty.html


def test_incomparable_runs_page_says_why_with_the_option_to_use(tmp_path, capsys):
    a, b = write_runs(tmp_path, config_b={"lr": 0.2})
    page = tmp_path / "r.html"
    code = main(["report", str(a), str(b), "-o", str(page)])
    out = capsys.readouterr().out
    assert code == EXIT_CANNOT_RUN and "INCOMPLETE" in out
    markup = page.read_text(encoding="utf-8")
    assert "could not compare" in markup and "--allow-config-diff" in markup
    assert "allow_config_diff" not in markup + out


def test_a_damaged_stream_is_never_identical(tmp_path, capsys):
    a, b = write_runs(tmp_path, plant=False)
    stream = b / "rank-00001.sbs"
    data = bytearray(stream.read_bytes())
    data[len(data) // 2] ^= 0x40  # one flipped bit inside a step frame
    stream.write_bytes(bytes(data))
    page = tmp_path / "r.html"
    code = main(["report", str(a), str(b), "-o", str(page)])
    out = capsys.readouterr().out
    assert code == EXIT_CANNOT_RUN and "INCOMPLETE" in out and "IDENTICAL" not in out
    markup = page.read_text(encoding="utf-8")
    assert "could not compare" in markup and "rank-00001.sbs" in markup
    assert 'class="verdict v-identical"' not in markup


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope"), "-o", str(tmp_path / "r.html")]) == EXIT_CANNOT_RUN
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "summary.json").write_text("{not json")
    assert main(["report", str(tmp_path / "out"), "-o", str(tmp_path / "r.html")]) == EXIT_CANNOT_RUN
    err = capsys.readouterr().err
    assert "summary.json: cannot be read as JSON" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty"), "-o", str(tmp_path / "r.html")]) == EXIT_CANNOT_RUN
    assert "no summary.json" in capsys.readouterr().err


def test_differing_records_lists_every_record_and_its_distance(tmp_path):
    a, b = write_runs(tmp_path)
    rows = differing_records(a, b, rank=0, step=6)  # step 6: weight moved one ulp, loss differs
    names = [(r["phase"], r["name"]) for r in rows]
    assert ("params", "layer.weight") in names and ("params", HOSTILE) in names
    assert ("params", "bias") not in names
    assert all(r["difference"] == "digest differs" for r in rows if r["kind"] == "tensor")
    assert differing_records(a, b, rank=0, step=2) == []


# -- the output of samebits verify (real runs), matrix and bisect --------------------------------

RESUMABLE = '''
import argparse, torch
parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--resume-from", default=None)
args = parser.parse_args()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
start = 0
if args.resume_from:  # PLANTED: the resume restores model and optimizer but not the RNG state
    state = torch.load(args.resume_from, weights_only=True)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
for step in range(start, 5):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, f"{args.ckpt}/step-{step}.pt")
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad(); loss.backward(); opt.step()
'''


@pytest.fixture(scope="module")
def verify_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    script = root / "train.py"
    script.write_text(RESUMABLE)
    cmd = [sys.executable, str(script)]
    resume = (*cmd, "--ckpt", "{out}", "--resume-from", "{from}/step-{step}.pt")
    result = verify(ZeroCode((*cmd, "--ckpt", "{out}"), resume), root / "v", resume_at=2)
    return root / "v", result


@pytest.mark.slow
def test_verify_output_in_a_browser(verify_out, tmp_path, capsys):
    out, result = verify_out
    assert result.verdict is Verdict.FAIL  # the planted resume bug
    page = tmp_path / "verify.html"
    code = main(["report", str(out), "-o", str(page)])
    assert code == EXIT_BAD_VERDICT, capsys.readouterr()
    assert_self_contained(page.read_text(encoding="utf-8"))
    dom = rendered_dom(page, tmp_path)
    assert_nothing_injected(dom)
    text = dom.all_text()
    assert dom.headings[0].startswith("samebits verify")
    assert "independent: a vs b: identical" in dom.headings and "resume: a vs c: diverged" in dom.headings
    # C resumed at step 2 and differs at its first step: steps before the resume are outside the window
    first = dom.cells("h-first")  # one rank: rows are record groups, each marked where it first differs
    assert first and all(", step 2: first divergence: " in cell for cell in first), first
    assert "loss, step 0: before the compared window" in dom.cells("h-outside")  # backward's root is the loss
    assert "FAIL" in text and "digests only: values not recorded" in text
    assert "environment.env.SAMEBITS_STEP_OFFSET" not in text  # samebits' own per-run settings are not differences
    screenshot(page, tmp_path, "report-verify-real")


MINIGPT = Path(__file__).parent / "scripts_resume" / "minigpt.py"


@pytest.mark.slow  # three real runs of a tiny GPT (about 25 s here)
def test_a_tiny_gpts_resume_fault_is_shown_as_a_picture_of_the_state_in_a_browser(tmp_path, capsys):
    """The issue's user: a tiny GPT with its own checkpoints (tests/scripts_resume/minigpt.py:
    AdamW, a LambdaLR warm-up and cosine, torch.save at step 3), resumed without its scheduler's
    state, under zero-code recording.  The report of that verify shows the scheduler's position
    and the learning rate as a picture: C holds A's state of step 0 at step 3, A's of step 1 at
    step 4; and its window and first step agree everywhere."""
    script = f"{sys.executable} {MINIGPT} --sched --out {{out}}"
    out = tmp_path / "v"
    code = main(["verify", "--out", str(out), "--resume-at", "3", "--resume-with",
                 f"{script} --resume-from {{from}} --bug sched", "--", *script.split()])
    assert code == EXIT_BAD_VERDICT, capsys.readouterr()
    capsys.readouterr()
    page = tmp_path / "resume.html"
    assert main(["report", str(out), "-o", str(page)]) == EXIT_BAD_VERDICT  # its work/ folder holds no stream
    terminal = capsys.readouterr().out
    assert re.search(r"resume: a vs c\s+DIVERGED\s+step 3\s+rank 0: step 4", terminal), terminal
    assert_self_contained(page.read_text(encoding="utf-8"))
    dom = rendered_dom(page, tmp_path)
    assert_nothing_injected(dom)
    assert "resume: a vs c: the training state, step by step (rank 0)" in dom.headings
    says = element_text(dom.markup, "census-says")
    assert "step 3: C holds A's LR scheduler 0 position (last_epoch) of step 0 (3 steps behind)" in says
    assert "step 4: C holds A's optimizer 0 learning rates of step 1 (3 steps behind)" in says  # equal at 3
    charts = re.findall(r'<svg class="chart state-chart" data-record="([^"]+)"', dom.markup)
    assert charts[:1] == ["sched0.last_epoch"] and "optim0.lr" in charts, charts
    assert not any(name.startswith("rng.python") for name in charts)  # differs between A and B too: left out
    assert "samebits verify --keep-going" in element_text(dom.markup, "census-cut")  # C was cut at step 4
    chart = re.search(r'data-record="sched0.last_epoch".*?</svg>', dom.markup, re.S).group(0)
    assert re.search(r'<circle class="state-differs"[^>]*><title>step 3: C holds A\'s LR scheduler 0 position '
                     r'\(last_epoch\) of step 0</title>', html.unescape(chart)), chart
    # the divergence: the records that differ, by module (wte, fc, head), never one row per digest
    table = re.search(r'<table id="per-tensor".*?</table>', dom.markup, re.S).group(0)
    rows = re.findall(r'<th class="mono rec" title="[^"]*">([^<]*)</th>', table)
    assert [row.split(" ")[0] for row in rows] == ["wte", "fc", "head"], rows
    screenshot(page, tmp_path, "report-resume-census", height=2900)  # down to the charts of the state


@pytest.mark.slow
def test_matrix_output_draws_its_failing_cell(verify_out, tmp_path):
    out, result = verify_out
    matrix = tmp_path / "m"
    matrix.mkdir()
    cell = CellResult(cell="single", precision="fp32", world_size=1, required=True, out=str(out), verify=result)
    summary = MatrixResult(out=str(matrix), baseline="single fp32", cells=[cell]).to_dict()
    (matrix / "summary.json").write_text(json.dumps(summary, default=str))
    report = build_report([matrix])
    assert report.kind == "matrix" and report.verdict is Verdict.FAIL
    assert [p.label for p in report.pairs] == ["single fp32 resume: a vs c"]
    assert report.pairs[0].first_by_rank == {0: (2, None)}
    assert "single" in report.html and "fp32" in report.html


def test_bisect_output_shows_origin_call_site_and_elements(tmp_path):
    out = tmp_path / "bisect"
    a, b = write_runs(out / "1-steps")
    dump_a = torch.linspace(0, 1, 12)
    dump_b = dump_a.clone()
    dump_b[3] = torch.nextafter(dump_b[3], torch.tensor(2.0))
    dump_b[7] = torch.nextafter(torch.nextafter(dump_b[7], torch.tensor(2.0)), torch.tensor(2.0))
    detail = compare_elements(dump_a, dump_b)
    elements = Elements(detail=detail, output="0", pair=["a1", "b1"], dumps=["a.pt", "b.pt"], same_values=False,
                        inputs_identical=True)
    origin = Origin(kind="op", conclusion=f"origin: aten::index_put at train.py:21 in {HOSTILE}", step=3, rank=1,
                    phase="params", module="layer", op="aten::index_put", event_id="/aten::index_put:0",
                    category="op", classification="origin", call_site=f"train.py:21 in {HOSTILE}", elements=elements,
                    catalog=None, detail="all inputs matched; its output 0 differs", state_differs=[],
                    state_differs_all=[])
    stage = Stage("steps", "phases", "all steps, every rank", {"a": 1.0, "b": 1.0}, "diverged", None, "origin")
    result = BisectResult(verdict=Verdict.DIVERGED, origin=origin, stages=[stage], out=str(out), compared="a vs b",
                          conclusion=origin.conclusion)
    (out / "summary.json").write_text(json.dumps(result.to_dict(), default=str))
    report = build_report([out])
    assert report.kind == "bisect" and report.verdict is Verdict.DIVERGED
    assert "Origin" in report.sections
    dom = Dom(report.html)
    assert_nothing_injected(dom)
    text = dom.all_text()
    assert f"train.py:21 in {HOSTILE_SHOWN}" in text
    assert "2 of 12 elements differ" in text and "max 2 ulp" in text
    assert report.pairs[0].first_by_rank == {0: (5, None), 1: (3, None)}


def test_report_json_and_exit_code_follow_the_verdict(tmp_path, capsys):
    a, b = write_runs(tmp_path, plant=False)
    code = main(["report", str(a), str(b), "-o", str(tmp_path / "r.html"), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == EXIT_OK and payload["verdict"] == "identical" and payload["pairs"][0]["verdict"] == "identical"


# -- the page a person reads: the conclusion first, the ulp growth, legible curves ---------------
#
# The four kinds of page, from inputs written with the stream API (fast): a run whose copy starts
# to differ at a known step by a planted amount that doubles every step (so the ulp distance
# grows), the resumed copy cut by the live check as verify's run C is, and the summaries the
# commands' own result types write.  Each page must lead with the sentence the terminal prints.

RESUME_AT, PLANT = 6, 8  # the resumed run C starts at step 6 and differs from step 8 on
TRAIN_STEPS = 20
CENSUS_SAYS = "the torch CPU generator of C is not A's (the checkpoint did not restore it)"
BISECT_SAYS = "origin: rng.torch_cpu: the torch CPU generator differs at step 8 (restored without A's state)"


def train(path: Path, *, ranks: int = 1, steps: int = TRAIN_STEPS, start: int = 0, plant: int | None = None,
          stop_at: int | None = None, census: bool = False) -> Path:
    """A small momentum-SGD-like run recorded per step: loss, grad_norm, lr, params, grads and
    optimizer state; from ``plant`` on one weight moves by a relative 2e-6 doubling each step.
    ``stop_at``: the run ends there and leaves the live check's stop marker, as run C does."""
    for rank in range(ranks):
        rec = samebits.Recorder(path, rank=rank, world_size=ranks, config={"lr": 0.1})
        weight = torch.linspace(-1, 1, 16, dtype=torch.float32).reshape(4, 4) + rank
        momentum = torch.zeros_like(weight)
        for step in range(steps):
            grad = torch.sin(weight * 3 + step) * 0.1
            momentum = 0.9 * momentum + grad
            weight = weight - 0.1 * momentum
            if plant is not None and step >= plant:
                weight = weight.clone()
                weight[0, 0] += weight[0, 0].abs() * 2e-6 * 2.0 ** (step - plant)
            if step < start:
                continue
            if census:  # a state record that differs first in step order: the bisection's red herring
                rng = torch.tensor([step, 1 if plant is not None and step >= plant else 0])
                rec.tensors(step, "state", [("rng.python", rng)])
            rec.metrics(step, loss=(weight ** 2).sum(), grad_norm=grad.norm(), lr=0.1)
            rec.tensors(step, "params", [("layer.weight", weight), ("layer.bias", torch.ones(3))])
            rec.tensors(step, "grads", [("layer.weight", grad)])
            rec.tensors(step, "optimizer", [("layer.weight.momentum_buffer", momentum)])
            if stop_at is not None and step == stop_at:
                break
        rec.close()
    if stop_at is not None:  # the marker the live check leaves (samebits.autorecord writes it so)
        (path / STOPPED_MARKER).write_text(json.dumps({"stopped_at": stop_at, "rank": 0, "reference": str(
            path.parent / "a"), "reason": "diverged from reference"}) + "\n")
    return path


def synthetic_verify(out: Path, *, stop: bool = True) -> VerifyResult:
    """A verify output directory whose resume diverges at step PLANT (C cut there by the live
    check unless ``stop`` is False), with the summary VerifyResult writes."""
    train(out / "a")
    train(out / "b")
    train(out / "c", start=RESUME_AT, plant=PLANT, stop_at=PLANT if stop else None)
    checks = {"independent": samebits.diff(out / "a", out / "b"),
              "resume": samebits.diff(out / "a", out / "c", start_step=RESUME_AT)}
    result = VerifyResult(str(out), checks, {"A": 1.0}, RESUME_AT, [], [],
                          explanations={"resume": [f"step {PLANT}, rank 0: {CENSUS_SAYS}"]})
    (out / "summary.json").write_text(json.dumps(result.to_dict(), default=str))
    return result


def terminal_lines(kind: str, result) -> list[str]:
    """What the terminal prints for ``result``, line by line (the command's own render)."""
    render = {"verify": render_verify, "bisect": render_bisect, "matrix": render_matrix, "diff": render_diff}[kind]
    return render(result).splitlines()


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, tuple[Path, Any, int]]:
    """kind -> (the input directory or directories, the result the terminal renders, the step of
    the first divergence the page's ulp plot marks)."""
    root = tmp_path_factory.mktemp("pages")
    made: dict[str, tuple[Any, Any, int]] = {}
    verify = synthetic_verify(root / "verify")
    made["verify"] = ([root / "verify"], verify, PLANT)

    bisect_out = root / "bisect"
    train(bisect_out / "1-steps" / "a", census=True)
    train(bisect_out / "1-steps" / "b", plant=PLANT, census=True)
    origin = Origin(kind="generator", conclusion=BISECT_SAYS, step=PLANT, rank=0, phase="state", module=None,
                    op=None, event_id=None, category="state", classification="origin", call_site="train.py:12",
                    elements=None, catalog=None, detail="", state_differs=["rng.torch_cpu"],
                    state_differs_all=["rng.python", "rng.torch_cpu"])
    stage = Stage("steps", "phases", "all steps, every rank", {"a": 1.0, "b": 1.0}, "diverged", None, "origin")
    bisected = BisectResult(verdict=Verdict.DIVERGED, origin=origin, stages=[stage], out=str(bisect_out),
                            compared="a vs b", conclusion=BISECT_SAYS)
    (bisect_out / "summary.json").write_text(json.dumps(bisected.to_dict(), default=str))
    made["bisect"] = ([bisect_out], bisected, PLANT)

    matrix_out = root / "matrix"
    matrix_out.mkdir()
    cell_verify = synthetic_verify(root / "cell")
    cell = CellResult(cell="dp2", precision="bf16", world_size=2, required=True, out=str(root / "cell"),
                      verify=cell_verify, bisect={"of": "resume", "conclusion": BISECT_SAYS, "out": str(bisect_out)})
    matrix = MatrixResult(out=str(matrix_out), baseline="dp2 bf16", cells=[cell])
    (matrix_out / "summary.json").write_text(json.dumps(matrix.to_dict(), default=str))
    made["matrix"] = ([matrix_out], matrix, PLANT)

    a = train(root / "diff" / "a", ranks=2)
    b = train(root / "diff" / "b", ranks=2, plant=PLANT)
    made["diff"] = ([a, b], samebits.diff(a, b), PLANT)
    return made


def element_text(markup: str, ident: str) -> str:
    """The text of the element with id ``ident`` in the browser's DOM, tags removed."""
    match = re.search(rf'<(\w+)[^>]*\bid="{ident}"[^>]*>(.*?)</\1>', markup, re.S)
    assert match is not None, f"no element #{ident} on the page"
    return html.unescape(re.sub(r"<[^>]+>", "", match.group(2)))


@pytest.mark.parametrize("kind", ["verify", "bisect", "matrix", "diff"])
def test_each_page_leads_with_the_terminals_conclusion_and_draws_ulp_growth_in_a_browser(pages, kind, tmp_path):
    inputs, result, first_step = pages[kind]
    report = build_report(inputs)
    assert report.kind == kind
    page = tmp_path / f"{kind}.html"
    page.write_text(report.html, encoding="utf-8")
    assert_self_contained(report.html)
    dom = rendered_dom(page, tmp_path)
    assert_nothing_injected(dom)
    # the conclusion comes first (right under the title) and is the terminal's sentence, word for word
    said = element_text(dom.markup, "conclusion")
    assert said == report.conclusion and said in terminal_lines(kind, result), (said, terminal_lines(kind, result))
    assert re.search(r"</h1>\s*<p class=\"conclusion[^\"]*\" id=\"conclusion\">", dom.markup)
    # the ulp growth: a log axis, the first divergence marked at its step, one line per metric
    assert re.search(r'<svg class="ulp-plot" id="ulp-plot" data-scale="log"', dom.markup)
    assert "ulps (log scale)" in dom.all_text()
    assert f"first divergence: step {first_step}" in dom.all_text()
    assert '<line class="first-divergence"' in dom.markup
    legend = element_text(dom.markup, "ulp-legend")
    assert "loss" in legend and "grad norm" in legend and "lr" in legend
    # the curves: names a person knows and a legend naming both runs (a solid, b dashed)
    curves = element_text(dom.markup, "curve-legend")
    names = report.pairs[-1].names
    assert f"a: {names[0]} (solid)" in curves and f"b: {names[1]} (dashed)" in curves
    assert 'class="curve-b"' in dom.markup and 'stroke-dasharray' in dom.markup
    assert {h.split(">")[-1] for h in re.findall(r"<h3>([^<]*)<span", dom.markup)} >= {"loss", "grad norm", "lr"}
    if kind == "bisect":  # the conclusion, never the red-herring census record the first stage's diff names
        assert BISECT_SAYS in said and "rng.python" not in said
        assert "state/rng.python" in dom.all_text()  # still shown, as what the bisection explains
    if kind in ("verify", "matrix"):  # C was cut by the live check: said once, never as differences
        assert "not run past the first divergence" in element_text(dom.markup, "tensor-notes")
        assert "step only in run a" not in dom.all_text()
        assert dom.cells("h-cut") and not [c for c in dom.cells("h-missing")]
    if kind == "matrix":  # what the terminal printed under the table: the census and the bisection
        text = dom.all_text()
        assert CENSUS_SAYS in text and BISECT_SAYS in text
    screenshot(page, tmp_path, f"report-{kind}")


def test_the_records_table_never_scrolls_sideways_and_cut_steps_are_one_line(tmp_path):
    result = synthetic_verify(tmp_path / "v")
    report = build_report([tmp_path / "v"])
    table = re.search(r'<table id="per-tensor".*?</table>', report.html, re.S).group(0)
    steps = re.findall(r"<tr><th>module \\ step</th>(.*?)</tr>", table)[0].count("<th>")
    assert steps == 1  # C ran one step past the resume that differs (step 8); the rest was cut
    assert "steps 9-19: not run past the first divergence (the live check stopped run C (resumed at step 6) at " \
           "step 8)" in html.unescape(report.html)
    assert "step only in run a" not in report.html and result.verdict is Verdict.FAIL
    # run to the end (verify --keep-going), 12 steps at most are listed: the ulp plot shows the rest
    synthetic_verify(tmp_path / "k", stop=False)
    report = build_report([tmp_path / "k"])
    table = re.search(r'<table id="per-tensor".*?</table>', report.html, re.S).group(0)
    assert re.findall(r"<tr><th>module \\ step</th>(.*?)</tr>", table)[0].count("<th>") == 12
    assert "not run past" not in report.html and "more steps run by both" not in report.html


def test_the_heatmap_bins_thousands_of_ranks_and_long_runs_into_readable_cells(tmp_path):
    ranks, steps = 150, 3
    for label in ("a", "b"):
        for rank in range(ranks):
            rec = samebits.Recorder(tmp_path / label, rank=rank, world_size=ranks)
            for step in range(steps):
                bump = 1.0 if label == "b" and rank == 77 and step >= 1 else 0.0
                rec.tensors(step, "params", [("w", torch.full((2,), float(step) + bump))])
            rec.close()
    report = build_report([tmp_path / "a", tmp_path / "b"])
    heat = re.search(r'<table class="heat" id="heatmap">.*?</table>', report.html, re.S).group(0)
    rows = re.findall(r'<th class="row">([^<]*)</th>', heat)
    assert len(rows) == 50 and rows[0] == "ranks 0-2" and rows[-1] == "ranks 147-149"  # 150 ranks, 3 a row
    assert 'title="ranks 75-77, step 1: first divergence (1 of 3 rank-steps; ranks 77)"' in heat
    assert "150 ranks in 50 rows of up to 3 ranks" in report.html

    long_steps = 450
    for label in ("c", "d"):
        rec = samebits.Recorder(tmp_path / label, rank=0, world_size=1)
        for step in range(long_steps):
            rec.metrics(step, loss=float(step) + (1e-3 if label == "d" and step >= 300 else 0.0))
        rec.close()
    report = build_report([tmp_path / "c", tmp_path / "d"])
    heat = re.search(r'<table class="heat" id="heatmap">.*?</table>', report.html, re.S).group(0)
    columns = re.findall(r'<tr><th class="row">loss</th>(.*?)</tr>', heat)[0].count("<td")
    assert columns == 113 and "450 steps in 113 columns of up to 4 steps" in report.html
    assert 'title="loss, steps 300-303: first divergence' in heat
    assert 'title="loss, steps 296-299: identical (1 record(s))"' in heat


@pytest.mark.slow  # two real runs of a script (about 25 s here)
def test_verify_keep_going_runs_b_to_the_end_so_the_whole_divergent_curve_exists(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(UNSEEDED)
    code = main(["verify", "--keep-going", "--out", str(tmp_path / "v"), "--", sys.executable, str(script)])
    out = capsys.readouterr().out
    assert code == EXIT_BAD_VERDICT, out
    run_b = samebits.open_run(tmp_path / "v" / "b")
    assert _steps_of(run_b) == list(range(UNSEEDED_STEPS))  # not stopped at step 0, where it first differs
    assert not (tmp_path / "v" / "b" / "stopped.json").exists()
    summary = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert [r["ended"] for r in summary["runs"]] == ["finished", "finished"]
    assert summary["checks"]["independent"]["first_divergence"]["step"] == 0
    # and the conclusion the terminal printed is the one the page leads with
    report = build_report([tmp_path / "v"])
    assert report.conclusion in out.splitlines() and report.conclusion.startswith("FAIL: the independent runs")


def test_verify_keep_going_with_across_is_refused(tmp_path, capsys):
    assert main(["verify", "--keep-going", "--across", "dp=1,2", "--out", str(tmp_path / "v")]) == EXIT_CANNOT_RUN
    assert "--keep-going applies to the A, B, C runs of verify" in capsys.readouterr().err


UNSEEDED_STEPS = 5
UNSEEDED = f'''
import torch
model = torch.nn.Linear(4, 1)  # no seed: A and B start from different weights
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({UNSEEDED_STEPS}):
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
'''


def _steps_of(run) -> list[int]:
    reader = run.stream(run.ranks[0])
    try:
        return [block.step for block in reader.steps()]
    finally:
        reader.close()


def test_conclusions_say_what_held_and_what_could_not_be_decided():
    def check(verdict: Verdict, incomplete: list[str]) -> DiffResult:
        return DiffResult("a", "b", verdict, None, [], {}, {}, incomplete=incomplete)

    checks = {"independent": check(Verdict.IDENTICAL, []), "resume": None}
    assert verify_conclusion(VerifyResult("out", checks, {}, None)) == (
        "PASS: the independent runs (A against B): bit-identical; not checked: the resume (A against C).")
    undecided = {"independent": check(Verdict.INCOMPLETE, ["rank-00001.sbs is cut short"])}
    assert verify_conclusion(VerifyResult("out", undecided, {}, None)) == (
        "INCOMPLETE: the independent runs (A against B) could not be decided (rank-00001.sbs is cut short).")
    assert bisect_conclusion(BisectResult(Verdict.DIVERGED, None, [], "out", "a vs b")) == (
        "DIVERGED: no origin was localised (see the stages)")


def test_the_sentence_is_chosen_by_the_command_the_typed_result_names():
    """`conclusion` reads typed results and picks the sentence by the command each names
    (``summary_of``), not by which keys a dictionary holds; a diff, which names none, is read
    in its dictionary form."""
    compared = {"ranks": 1, "steps": 2, "records": 3, "steps_identical_by_root": 2}
    same = DiffResult("a", "b", Verdict.IDENTICAL, None, [], {}, compared)
    verified = VerifyResult("out", {"independent": same, "resume": None}, {}, None)
    assert conclusion(verified) == verify_conclusion(verified) == (
        "PASS: the independent runs (A against B): bit-identical; not checked: the resume (A against C).")
    assert conclusion(BisectResult(Verdict.IDENTICAL, None, [], "out", "a vs a")) == "IDENTICAL: the runs are identical"
    assert conclusion(same.to_dict()) == ("IDENTICAL: bit for bit. 1 rank(s) x 2 step(s), 3 records compared "
                                          "(2 step(s) equal by root)")
