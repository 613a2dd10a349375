"""`samebits report` of a resumed run: one window and one first step everywhere, the state
census drawn, the differing tensors grouped by module (issue 35 items 3-4).

The runs are written with the stream API, as zero-code recording writes them: a main stream
(the loss, each module's parameters, gradients and Adam state) and a census stream (``RUN/state``:
the generators at each step start and end, the optimizer's step counts and learning rates, the
LR scheduler's position, the step's input batch).  Run c resumes a's checkpoint of step
RESUME_AT without restoring its LR scheduler, which restarts at 0, so its parameters part from
a's one step later: the shape of the tiny-GPT report in the issue, where the page said "DIVERGED
at step 5" over a table saying "rank 0: step 0".
"""

from __future__ import annotations

import json
import re

import torch

import samebits
from samebits.checkpoint import CENSUS_DIR
from samebits.cli import main
from samebits.runners.conclusion import diff_conclusion, diff_window
from samebits.runners.report import build_report
from samebits.runners.verify import VerifyResult
from samebits.verdicts import EXIT_BAD_VERDICT

STEPS, RESUME_AT = 8, 4
PARAMS = ("wte.weight", "fc.weight", "fc.bias", "head.weight")


def _lr(position: int) -> float:
    return 1e-2 * (0.5 ** position)


HOSTILE = '<img src=x onerror=alert(1)></script>"\'\x1b[31m'  # a generator's name, as a program may give it


def write_run(path, *, start: int = 0, scheduler_restarts: bool = False, hostile: bool = False):
    """One run's main and census streams from ``start`` on; ``scheduler_restarts``: the LR
    scheduler was not restored, so its position is the steps since ``start``."""
    main_rec = samebits.Recorder(path, rank=0, world_size=1)
    census = samebits.Recorder(path / CENSUS_DIR, rank=0, world_size=1)
    weights = {name: torch.full((4,), float(i)) for i, name in enumerate(PARAMS)}
    unseeded = torch.tensor([7 if scheduler_restarts else 3])  # an unseeded generator nobody draws from
    for step in range(STEPS):
        position = step - start if scheduler_restarts and step >= start else step
        if step >= start:
            record(main_rec, census, step, position, weights, unseeded, hostile)
        for name in PARAMS:  # the step's update uses the LR of the scheduler's position
            weights[name] = weights[name] - _lr(position)
    main_rec.close()
    census.close()
    return path


def record(main_rec, census, step: int, position: int, weights: dict, unseeded, hostile: bool) -> None:
    """One step's records, as zero-code recording writes them (the loss after the tensors here,
    so the first record to differ is a parameter); ``hostile``: a generator of the program's own,
    drawn each step, that the other run does not have, named as a program may name it."""
    census.tensors(step, "state", [("rng.python", unseeded), ("rng.torch_cpu", torch.tensor([2 * step])),
                                   ("optim0.step", torch.tensor([float(step)] * 2, dtype=torch.float64)),
                                   ("optim0.lr", torch.tensor([_lr(position)], dtype=torch.float64)),
                                   ("sched0.last_epoch", torch.tensor([position]))])
    census.tensors(step, "inputs", [("Model.0", torch.arange(4) + step)])
    census.tensors(step, "state_end", [("rng.python", unseeded), ("rng.torch_cpu", torch.tensor([2 * step + 1]))])
    if hostile:
        census.tensors(step, "state", [(f"rng.user.{HOSTILE}", torch.tensor([step]))])
        census.tensors(step, "state_end", [(f"rng.user.{HOSTILE}", torch.tensor([step + 100]))])
    census.end_step(step)
    main_rec.tensors(step, "params", list(weights.items()))
    main_rec.tensors(step, "grads", [(name, w * 0 + 1) for name, w in weights.items()])
    main_rec.tensors(step, "optimizer", [(f"{name}.exp_avg", w * 0.1) for name, w in weights.items()])
    main_rec.metrics(step, "backward", root=float(weights["fc.weight"].sum()))
    main_rec.end_step(step)


def resumed_pair(tmp_path):
    return write_run(tmp_path / "a"), write_run(tmp_path / "c", start=RESUME_AT, scheduler_restarts=True)


def test_a_resumed_run_has_one_window_and_one_first_step_in_every_part_of_the_report(tmp_path, capsys):
    a, c = resumed_pair(tmp_path)
    page = tmp_path / "r.html"
    assert main(["report", str(a), str(c), "-o", str(page)]) == EXIT_BAD_VERDICT
    out = capsys.readouterr().out
    said = f"DIVERGED at step 5, rank 0: params/wte.weight (compared from step {RESUME_AT}, where b starts: b resumed a run)"
    assert said in out.splitlines()  # the headline names the window diff chose
    row = next(line for line in out.splitlines() if line.startswith("a vs c"))
    assert "rank 0: step 5" in row and "step 0" not in row.replace(f"step {RESUME_AT}", "")  # was "rank 0: step 0"
    assert f"step {RESUME_AT}" in row  # the table's window column
    # and the state that explains it, as the page draws it
    assert f"  a vs c: step {RESUME_AT}: b holds a's LR scheduler 0 position (last_epoch) of step 0 (4 steps " \
           "behind)" in out.splitlines()
    # the JSON says the same, pair by pair
    assert main(["report", str(a), str(c), "-o", str(page), "--json"]) == EXIT_BAD_VERDICT
    payload = json.loads(capsys.readouterr().out)
    pair = payload["pairs"][0]
    assert payload["conclusion"] == said and pair["conclusion"] == said
    assert pair["start_step"] == RESUME_AT and pair["window"].startswith(f"compared from step {RESUME_AT}")
    assert pair["first_divergence"] == {"step": 5, "rank": 0, "record": "params/wte.weight"}
    assert pair["first_divergent_step_by_rank"] == {"0": 5}
    # the page: the window in the pair's section, diff's own note kept, the heatmap's first step
    markup = page.read_text(encoding="utf-8")
    assert f'<span class="window">compared from step {RESUME_AT}, where b starts: b resumed a run</span>' in markup
    assert f"b starts at step {RESUME_AT} and a at step 0 (b resumed a run?): compared from step {RESUME_AT} on" in \
        markup
    first = re.findall(r'<td class="h-first" title="([^"]*)"', markup)
    assert first and all(", step 5: first divergence" in cell for cell in first), first
    assert "before the compared window" in markup  # steps 0-3 are a's only: outside, never a difference


def test_diff_conclusion_names_the_window_only_when_diff_chose_it():
    result = {"verdict": "diverged", "first_divergence": {"step": 5, "rank": 0, "phase": "params", "name": "w"},
              "resumed": {"run": "b", "step": 4},  # the window diff chose, as its result writes it
              "notes": ["b starts at step 4 and a at step 0 (b resumed a run?): compared from step 4 on"]}
    assert diff_window(result) == (4, "b")
    assert diff_conclusion(result) == "DIVERGED at step 5, rank 0: params/w (compared from step 4, where b starts: " \
                                      "b resumed a run)"
    del result["resumed"]  # the note alone is words for a person, never read back
    assert diff_window(result) is None and diff_conclusion(result) == "DIVERGED at step 5, rank 0: params/w"


def test_the_resumed_runs_state_is_drawn_as_the_step_of_a_it_holds(tmp_path):
    a, c = resumed_pair(tmp_path)
    report = build_report([a, c])
    census = report.to_dict()["pairs"][0]["census"]
    differ = {track["record"]: track for track in census["differ"]}
    # the scheduler restarted at 0: at each step c holds a's scheduler position of 4 steps before
    assert differ["sched0.last_epoch"]["positions"] == {str(s): s - RESUME_AT for s in range(RESUME_AT, STEPS)}
    assert differ["optim0.lr"]["positions"] == {str(s): s - RESUME_AT for s in range(RESUME_AT, STEPS)}
    assert set(differ) == {"sched0.last_epoch", "optim0.lr"}
    assert {"torch CPU generator", "optimizer 0 step counts", "input batch (data position)"} <= set(census["same"])
    # an unseeded generator nobody draws from differs and explains nothing: left out, with why
    assert {"title": "Python random generator", "why": "drawn in no compared step of either run: its state explains "
                                                      "nothing"} in census["left_out"]
    assert report.sections.index("a vs c: the training state, step by step (rank 0)") < \
        report.sections.index("a vs c: ulp growth (rank 0)")  # a resume's picture comes first
    markup = report.html
    chart = re.search(r'<svg class="chart state-chart" data-record="sched0.last_epoch".*?</svg>', markup, re.S)
    assert chart is not None, "no picture of the scheduler's position"
    held = re.findall(r'<circle class="state-differs"[^>]*><title>([^<]*)</title>', chart.group(0))
    assert held[0] == f"step {RESUME_AT}: b holds a&#x27;s LR scheduler 0 position (last_epoch) of step 0"
    assert len(held) == STEPS - RESUME_AT
    assert 'class="state-a"' in chart.group(0) and 'class="state-b"' in chart.group(0)
    assert f"step {RESUME_AT}: b holds a&#x27;s LR scheduler 0 position (last_epoch) of step 0 (4 steps behind)" \
        in markup


def test_the_records_that_differ_are_grouped_by_module_not_listed_as_digest_rows(tmp_path):
    a, c = resumed_pair(tmp_path)
    report = build_report([a, c])
    table = re.search(r'<table id="per-tensor".*?</table>', report.html, re.S).group(0)
    rows = re.findall(r'<th class="mono rec" title="[^"]*">([^<]*)</th>', table)
    assert rows == ["loss (backward/root)", "wte (params: weight; optimizer state: weight.exp_avg)",
                    "fc (params: weight, bias; optimizer state: weight.exp_avg, bias.exp_avg)",
                    "head (params: weight; optimizer state: weight.exp_avg)"]
    # a module's cell: how many of its records differ (of its params, their grads and Adam state)
    assert re.search(r'<td class="t-ne" title="4 of 6 record\(s\) differ: params/fc.weight \(digest differs\); '
                     r'params/fc.bias \(digest differs\); optimizer/fc.weight.exp_avg \(digest differs\); '
                     r'optimizer/fc.bias.exp_avg \(digest differs\)">4 of 6</td>', table)
    assert ">digest<" not in table


def test_a_verify_folder_whose_program_wrote_a_work_folder_is_reported(tmp_path, capsys):
    """verify gives a command's runs {out} = OUT/work/a, b, c (checkpoints, logs: no stream);
    the report of OUT reads its runs and leaves the program's own folders alone (it refused the
    whole folder: "OUT/work/a: no fingerprint streams")."""
    out = tmp_path / "v"
    a, c = write_run(out / "a"), write_run(out / "c", start=RESUME_AT, scheduler_restarts=True)
    write_run(out / "b")
    for run in ("a", "b", "c"):
        (out / "work" / run).mkdir(parents=True)
        (out / "work" / run / "ckpt.pt").write_bytes(b"not a stream")
    checks = {"independent": samebits.diff(a, out / "b"), "resume": samebits.diff(a, c, start_step=RESUME_AT)}
    (out / "summary.json").write_text(json.dumps(VerifyResult(str(out), checks, {"A": 1.0}, RESUME_AT, [], [])
                                                 .to_dict(), default=str))
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == EXIT_BAD_VERDICT, capsys.readouterr().err
    said = capsys.readouterr().out
    assert re.search(r"resume: a vs c\s+DIVERGED\s+step 4\s+rank 0: step 5", said), said
    assert main(["report", str(out / "nope"), "-o", str(tmp_path / "r.html")]) == 2  # still refused at once
    assert "no such directory" in capsys.readouterr().err


def test_a_hostile_generator_name_in_the_census_is_text(tmp_path):
    a = write_run(tmp_path / "a")
    c = write_run(tmp_path / "c", start=RESUME_AT, scheduler_restarts=True, hostile=True)
    report = build_report([a, c])
    differ = {t["record"]: t for t in report.to_dict()["pairs"][0]["census"]["differ"]}
    assert differ[f"rng.user.{HOSTILE}"]["only_in"] == {str(s): "b" for s in range(RESUME_AT, STEPS)}
    assert "<img" not in report.html and "</script>" not in report.html and "\x1b" not in report.html
    assert "&lt;img src=x onerror=alert(1)&gt;&lt;/script&gt;&quot;&#x27;\\x1b[31m" in report.html
