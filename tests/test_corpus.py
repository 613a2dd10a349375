"""The detection corpus (tests/corpus/): a well-formed manifest, PLANTED markers where the
manifest says, scripts that run, a strict matcher, and a few cases end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
SPEC = importlib.util.spec_from_file_location("bench_detection", ROOT / "benchmarks" / "bench_detection.py")
bench = importlib.util.module_from_spec(SPEC)
sys.modules["bench_detection"] = bench  # dataclasses look their module up by name
SPEC.loader.exec_module(bench)

CASES = bench.load_cases()
BY_NAME = {case["name"]: case for case in CASES}
SCRIPTS = sorted(CORPUS.glob("*.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _marked_lines(script: Path) -> list[int]:
    return [n for n, line in enumerate(script.read_text().splitlines(), 1) if "# PLANTED" in line]


# --- the manifest -------------------------------------------------------------------------

def test_manifest_is_well_formed():
    assert len(CASES) >= 15
    assert len(BY_NAME) == len(CASES), "case names must be unique"
    settings = {case["setting"] for case in CASES}
    assert {"plain loop", "DDP over gloo, 2 ranks", "HF Trainer, tiny GPT-2"} <= settings
    for case in CASES:
        assert set(case) <= {"name", "setting", "fault", "planted", "samebits", "run", "expected", "requires",
                             "runs_differ"}, case["name"]
        assert case["samebits"][0] in ("bisect", "verify"), case["name"]
        assert "--json" not in case["samebits"] and "--out" not in case["samebits"], case["name"]
        assert case["run"] and case["fault"], case["name"]
        exp = case["expected"]
        if "exit" in exp:
            assert exp["exit"] == 2 and exp["origin"] == {"class": "crash"}
        elif "resume_diverged_at" in exp:
            assert case["samebits"][0] == "verify" and "--resume-with" in case["samebits"]
            assert exp["verdict"] == "fail" and exp["independent"] == "identical"
        else:
            assert case["samebits"][0] == "bisect" and exp["verdict"] == "diverged"
            origin = exp["origin"]
            assert set(origin) <= {"class", "file_line"} and origin, case["name"]
            if "class" in origin:
                assert origin["class"] in bench.CLASS_KINDS, case["name"]
            else:
                assert "file_line" in origin
            assert exp.get("phase", "forward") in ("forward", "backward", "optimizer", "reduce"), case["name"]


def test_planted_markers_match_the_manifest():
    for script in SCRIPTS:
        assert len(_marked_lines(script)) == 1, f"{script.name}: exactly one line must carry '# PLANTED'"
    used = set()
    for case in CASES:
        name, _, line = case["planted"].partition(":")
        script = CORPUS / name
        assert script.exists(), case["name"]
        assert _marked_lines(script) == [int(line)], f"{case['name']}: {case['planted']} is not the PLANTED line"
        assert any(name in part for part in case["run"]), f"{case['name']}: the command does not run {name}"
        file_line = case["expected"].get("origin", {}).get("file_line")
        if file_line is not None:
            assert file_line == case["planted"], case["name"]
        used.add(name)
    assert used == {s.name for s in SCRIPTS}, "every corpus script belongs to a case"


def test_samebits_argv_expands_placeholders(tmp_path):
    argv = bench.samebits_argv(BY_NAME["resume_data_position"], tmp_path)
    assert argv[:4] == [sys.executable, "-m", "samebits", "verify"]
    assert argv[argv.index("--out") + 1] == str(tmp_path / "out")
    assert argv.index("--json") < argv.index("--")
    resume_with = argv[argv.index("--resume-with") + 1]
    assert str(CORPUS / "resume_data_position.py") in resume_with and "{from}" in resume_with
    assert not any("{python}" in a or "{corpus}" in a for a in argv)


# --- the scripts run ------------------------------------------------------------------------

def _run(argv, tmp_path, timeout=120):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAMEBITS_")}
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


PLAIN = [c for c in CASES if c["setting"] == "plain loop" and c["samebits"][0] == "bisect"
         and "exit" not in c["expected"]]


@pytest.mark.parametrize("case", PLAIN, ids=[c["name"] for c in PLAIN])
def test_plain_script_runs(case, tmp_path):
    proc = _run(bench.expand(case["run"], tmp_path) + ["--steps", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"step 2 loss \d", proc.stdout)


@pytest.mark.parametrize("name", ["resume_data_position", "resume_lr_scheduler"])
def test_resume_script_saves_and_resumes(name, tmp_path):
    script = str(CORPUS / f"{name}.py")
    first = _run([sys.executable, script, "--ckpt", str(tmp_path / "a"), "--steps", "3"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _run([sys.executable, script, "--ckpt", str(tmp_path / "c"), "--steps", "3",
                    "--resume", str(tmp_path / "a" / "step1.pt")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.startswith("step 1 ") and "step 0 " not in resumed.stdout


def test_crash_script_crashes_after_clean_steps(tmp_path):
    proc = _run([sys.executable, str(CORPUS / "crash_mid_run.py")], tmp_path)
    assert proc.returncode != 0 and "IndexError" in proc.stderr
    assert "step 2 loss" in proc.stdout and "step 3 loss" not in proc.stdout


DDP = [c for c in CASES if c["setting"].startswith("DDP")]


@pytest.mark.parametrize("case", DDP, ids=[c["name"] for c in DDP])
def test_ddp_script_runs_on_two_ranks(case, tmp_path):
    script = bench.expand(case["run"], tmp_path)[-1]
    proc = _run(TORCHRUN + [script, "--steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 step 1 loss" in proc.stdout and "rank 1 step 1 loss" in proc.stdout


def test_hf_trainer_script_runs(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    case = BY_NAME["hf_trainer_collator"]
    proc = _run(bench.expand(case["run"], tmp_path) + ["--steps", "2"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'loss'" in proc.stdout + proc.stderr


def test_bench_skips_a_case_whose_requirements_are_missing():
    case = dict(BY_NAME["hf_trainer_collator"], requires=["no_such_module_samebits_corpus"])
    score = bench.run_case(case, timeout=5)
    assert score.outcome == "skipped" and "no_such_module_samebits_corpus" in score.why
    assert bench.totals([score])["ran"] == 0


# --- the matcher is strict -----------------------------------------------------------------

def _bisect(kind, *, site=None, step=0, phase="forward", conclusion="", state=(), classification="origin",
            verdict="diverged"):
    origin = {"kind": kind, "conclusion": conclusion, "step": step, "rank": 0, "phase": phase, "module": "",
              "op": "aten::index_put_", "id": "/aten::index_put_:0", "category": "op",
              "classification": classification, "call_site": site, "state_differs": list(state)}
    return {"verdict": verdict, "origin": origin, "notes": []}


def test_matcher_file_line():
    case = BY_NAME["root_forward_index"]
    here = "/x/tests/corpus/root_forward_index.py:29 in forward"
    assert bench.judge(case, _bisect("op", site=here, phase="backward"), 1, "")[0] == "hit"
    assert bench.judge(case, _bisect("op", site=here, phase="forward"), 1, "")[0] == "wrong"
    assert bench.judge(case, _bisect("op", site="/x/root_forward_index.py:30 in f", phase="backward"), 1, "")[0] \
        == "wrong"
    assert bench.judge(case, _bisect("op", site=here, phase="backward", step=1), 1, "")[0] == "wrong"
    assert bench.judge(case, _bisect("not_localised", classification="receiver"), 1, "")[0] == "miss"
    assert bench.judge(case, _bisect("below_dispatcher"), 1, "")[0] == "miss"
    assert bench.judge(case, _bisect("op", site=None, phase="backward"), 1, "")[0] == "miss"
    assert bench.judge(case, _bisect("input_batch"), 1, "")[0] == "wrong"
    assert bench.judge(case, {"verdict": "identical", "origin": None}, 0, "")[0] == "wrong"
    assert bench.judge(case, None, 2, "samebits bisect: error: ...")[0] == "miss"
    assert bench.judge(case, None, None, "")[0] == "miss"  # timeout


def test_matcher_classes():
    batch = BY_NAME["sampler_time_seed"]
    assert bench.judge(batch, _bisect("input_batch"), 1, "")[0] == "hit"
    assert bench.judge(batch, _bisect("op", site="/x/sampler_time_seed.py:30 in <module>"), 1, "")[0] == "wrong"
    assert bench.judge(batch, _bisect("not_localised", classification="receiver"), 1, "")[0] == "miss"
    gen = BY_NAME["dropout_time_seed"]
    named = "torch CPU RNG state differs at step start: ... the RNG op aten::bernoulli_ drew different numbers"
    assert bench.judge(gen, _bisect("generator", conclusion=named), 1, "")[0] == "hit"
    vague = "Python `random` state differs at step start; NumPy global random state differs; " + named
    assert bench.judge(gen, _bisect("generator", conclusion=vague), 1, "")[0] == "miss"
    assert bench.judge(gen, _bisect("generator", conclusion="NumPy global random state differs"), 1, "")[0] \
        == "wrong"
    assert bench.judge(gen, _bisect("generator", conclusion="a generator was in another state"), 1, "")[0] == "miss"
    assert bench.judge(gen, _bisect("generator", conclusion="the generator was in another state"), 1, "")[0] \
        == "miss"
    assert bench.judge(gen, _bisect("op", site="/x/dropout_time_seed.py:26 in <module>"), 1, "")[0] == "wrong"
    order = BY_NAME["set_param_order"]
    assert bench.judge(order, _bisect("order", site="/x/set_param_order.py:29 in <module>"), 1, "")[0] == "hit"
    assert bench.judge(order, _bisect("order"), 1, "")[0] == "miss"
    assert bench.judge(order, _bisect("order", site="/x/set_param_order.py:31 in <module>"), 1, "")[0] == "wrong"
    seed = BY_NAME["ddp_per_rank_seed"]  # repeats run to run: identical is a miss, not a wrong verdict
    assert bench.judge(seed, {"verdict": "identical", "origin": None}, 0, "")[0] == "miss"
    assert bench.judge(seed, _bisect("replicas"), 1, "")[0] == "hit"


def test_matcher_crash_and_verify():
    crash = BY_NAME["crash_mid_run_verify"]
    assert bench.judge(crash, None, 2, "samebits verify: error: run A failed")[0] == "hit"
    assert bench.judge(crash, {"verdict": "pass", "checks": {}}, 0, "")[0] == "wrong"
    assert bench.judge(crash, {"verdict": "fail", "checks": {}}, 1, "")[0] == "wrong"
    resume = BY_NAME["resume_lr_scheduler"]

    def verify(independent, resume_step):
        checks = {"independent": {"verdict": independent, "first_divergence": None},
                  "resume": {"verdict": "diverged", "first_divergence": {"step": resume_step}}}
        return {"verdict": "fail", "checks": checks}
    assert bench.judge(resume, verify("identical", 4), 1, "")[0] == "hit"
    assert bench.judge(resume, verify("identical", 5), 1, "")[0] == "wrong"
    assert bench.judge(resume, verify("diverged", 4), 1, "")[0] == "wrong"
    assert bench.judge(resume, {"verdict": "pass", "checks": {}}, 0, "")[0] == "wrong"


# --- end to end through samebits (the fastest cases) ----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["crash_mid_run_verify", "resume_data_position", "sampler_time_seed"])
def test_case_end_to_end(name):
    score = bench.run_case(BY_NAME[name], timeout=240)
    assert score.outcome == "hit", (score.got, score.why, score.said)


def test_totals_count_skipped_cases_apart(tmp_path):
    rows = [("a", "hit"), ("b", "miss"), ("c", "wrong"), ("d", "skipped")]
    scores = [bench.Score(name, "plain loop", "exp", "got", outcome, "why", 10.0, 1) for name, outcome in rows]
    t = bench.totals(scores)
    assert (t["ran"], t["hit"], t["miss"], t["wrong"], t["skipped"]) == (3, 1, 1, 1, 1)
    assert t["accuracy"] == 0.333
    assert "1/3 = 33%" in bench.render(scores) and "wrong 1" in bench.render(scores)
    saved = tmp_path / "scores.json"
    saved.write_text(json.dumps({"scores": [bench.asdict(s) for s in scores], "totals": t}))
    assert bench.main(["--from-json", str(saved), "--markdown"]) == 0
    assert bench.main(["--case", "no_such_case"]) == 2
