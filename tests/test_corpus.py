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
import torch

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

FILE_LINE = re.compile(r"[A-Za-z0-9_]+\.py:[1-9][0-9]*")
GENERATOR = re.compile(r"torch_cpu|python|numpy|user:[A-Za-z0-9_]+\.py:[1-9][0-9]*")


def _places(value) -> list[str]:
    """A file_line/site expectation: one `x.py:N` or a non-empty list of them; [] if malformed."""
    places = [value] if isinstance(value, str) else value
    if not isinstance(places, list) or not places or not all(isinstance(p, str) and FILE_LINE.fullmatch(p)
                                                            for p in places):
        return []
    return places


def _explains_problems(explains) -> list[str]:
    if not isinstance(explains, dict):
        return ["explains must be an object"]
    problems = []
    if set(explains) - {"kind", "site", "generator"}:
        problems.append(f"explains has unknown fields {sorted(set(explains) - {'kind', 'site', 'generator'})}")
    if explains.get("kind") not in bench.FINDING_KINDS:
        problems.append(f"explains kind {explains.get('kind')!r} is not a verify finding kind")
    if "site" in explains and not _places(explains["site"]):
        problems.append("explains site must be x.py:N or a list of them")
    if "generator" in explains:
        if explains.get("kind") not in ("generator", "generator_consumed"):
            problems.append("explains generator belongs to a generator finding")
        if not isinstance(explains["generator"], str) or not GENERATOR.fullmatch(explains["generator"]):
            problems.append("explains generator must be torch_cpu, python, numpy or user:x.py:N")
    return problems


def manifest_problems(case: dict) -> list[str]:
    """What is wrong with one case of cases.json ([] for a well-formed one)."""
    name = case.get("name", "?")
    problems = []
    if set(case) - {"name", "setting", "fault", "planted", "samebits", "run", "expected", "requires", "runs_differ"}:
        problems.append("unknown fields")
    if not case.get("run") or not case.get("fault") or not case.get("setting"):
        problems.append("run, fault and setting are required")
    samebits = case.get("samebits") or ["?"]
    if samebits[0] not in ("bisect", "verify"):
        problems.append(f"samebits command {samebits[0]!r}")
    if "--json" in samebits or "--out" in samebits:
        problems.append("--json and --out are the benchmark's")
    if not _places(case.get("planted")):
        problems.append("planted must be x.py:N")
    exp = case.get("expected") or {}
    verify, resume = samebits[0] == "verify", "--resume-with" in samebits
    if "exit" in exp:
        if exp != {"exit": 2, "origin": {"class": "crash"}}:
            problems.append("a crash case expects exactly exit 2 and class crash")
    elif "resume_diverged_at" in exp:
        if not (verify and resume and "--resume-at" in samebits):
            problems.append("resume_diverged_at needs verify --resume-with ... --resume-at K")
        if set(exp) - {"verdict", "independent", "resume_diverged_at", "origin", "explains"}:
            problems.append("unknown expected fields")
        if exp.get("verdict") != "fail" or exp.get("independent") != "identical":
            problems.append("a resume case expects FAIL with A = B identical")
        if not isinstance(exp["resume_diverged_at"], int) or exp["resume_diverged_at"] < 1:
            problems.append("resume_diverged_at is a step after the first")
        if exp.get("origin") != {"class": "resume"}:
            problems.append("a resume case's origin is class resume")
    elif "independent_diverged_at" in exp:
        if not verify or resume:
            problems.append("independent_diverged_at needs verify without --resume-with")
        if set(exp) - {"verdict", "independent_diverged_at", "origin", "explains"}:
            problems.append("unknown expected fields")
        if exp.get("verdict") != "fail":
            problems.append("an independent case expects FAIL")
        if not isinstance(exp["independent_diverged_at"], int) or exp["independent_diverged_at"] < 0:
            problems.append("independent_diverged_at is a step")
        if exp.get("origin") != {"class": "independent"}:
            problems.append("an independent case's origin is class independent")
    else:
        if samebits[0] != "bisect" or exp.get("verdict") != "diverged":
            problems.append("a bisect case expects verdict diverged")
        if "explains" in exp:
            problems.append("explains belongs to a verify case")
        origin = exp.get("origin")
        if not isinstance(origin, dict) or not origin or set(origin) - {"class", "file_line"}:
            problems.append("origin must hold class and/or file_line")
        else:
            if "class" in origin and origin["class"] not in bench.CLASS_KINDS:
                problems.append(f"unknown class {origin['class']!r}")
            if "file_line" in origin and not _places(origin["file_line"]):
                problems.append("file_line must be x.py:N or a list of them")
            if "class" not in origin and "file_line" not in origin:
                problems.append("origin needs a class or a file_line")
            if origin.get("class") == "generator:user" and "file_line" not in origin:
                problems.append("generator:user needs the generator's creation site as file_line")
        if exp.get("phase", "forward") not in ("forward", "backward", "optimizer", "reduce"):
            problems.append(f"phase {exp.get('phase')!r}")
    if verify and "exit" not in exp and "resume_diverged_at" not in exp and "independent_diverged_at" not in exp:
        problems.append("a verify case expects exit 2, resume_diverged_at or independent_diverged_at")
    if "explains" in exp:
        problems += _explains_problems(exp["explains"])
    return [f"{name}: {p}" for p in problems]


def test_manifest_is_well_formed():
    assert len(CASES) >= 30
    assert len(BY_NAME) == len(CASES), "case names must be unique"
    settings = {case["setting"] for case in CASES}
    assert {"plain loop", "DDP over gloo, 2 ranks", "HF Trainer, tiny GPT-2", "nanoGPT-style train.py",
            "DataLoader loop", "Lightning"} <= settings
    assert [p for case in CASES for p in manifest_problems(case)] == []
    verify_cases = [c for c in CASES if c["samebits"][0] == "verify" and "exit" not in c["expected"]]
    assert all("explains" in c["expected"] for c in verify_cases), "every verify case says what explains it"


@pytest.mark.parametrize("change", [
    lambda e: e["explains"].update(kind="optimizer"),                 # not a finding kind
    lambda e: e["explains"].update(site="gpt_resume_reinit.py"),      # no line
    lambda e: e["explains"].update(site=[]),                          # no place at all
    lambda e: e["explains"].update(generator="torch_cpu"),            # not a generator finding
    lambda e: e["explains"].update(why="x"),                          # unknown field
    lambda e: e.update(explains="model_params"),                      # not an object
    lambda e: e.update(independent="diverged"),                       # a resume case's A = B
    lambda e: e.update(resume_diverged_at=0),                         # no resume at step 0
    lambda e: e.update(origin={"class": "input batch"}),              # a bisect class
    lambda e: e.update(independent_diverged_at=0),                    # both kinds of verify case
])
def test_manifest_check_rejects_a_malformed_resume_case(change):
    case = json.loads(json.dumps(BY_NAME["gpt_resume_reinit"]))
    assert manifest_problems(case) == []
    change(case["expected"])
    assert manifest_problems(case), case["expected"]


@pytest.mark.parametrize("name, change", [
    ("gpt_private_generator_verify", lambda c: c["expected"]["explains"].update(generator="user:x.py")),
    ("gpt_private_generator_verify", lambda c: c["expected"]["explains"].update(generator="torch_gpu")),
    ("gpt_private_generator_verify", lambda c: c["samebits"].extend(["--resume-with", "x", "--resume-at", "1"])),
    ("gpt_private_generator_verify", lambda c: c["expected"].pop("independent_diverged_at")),
    ("gpt_private_generator_bisect", lambda c: c["expected"].update(explains={"kind": "generator"})),
    ("gpt_private_generator_bisect", lambda c: c["expected"]["origin"].pop("file_line")),
    ("gpt_private_generator_bisect", lambda c: c["expected"]["origin"].update(file_line=["x.py:0"])),
    ("gpt_set_param_groups_bisect", lambda c: c["expected"]["origin"].update(file_line=[])),
    ("gpt_set_param_groups_bisect", lambda c: c["expected"]["origin"].update(klass="order")),
    ("gpt_set_param_groups_bisect", lambda c: c["expected"]["origin"].update({"class": "order"})),
    ("crash_mid_run_verify", lambda c: c["expected"].update(explains={"kind": "script_said"})),
    ("resume_lr_scheduler", lambda c: c["samebits"].remove("--resume-with")),
    ("resume_lr_scheduler", lambda c: c.update(planted="resume_lr_scheduler.py")),
])
def test_manifest_check_rejects_malformed_cases(name, change):
    case = json.loads(json.dumps(BY_NAME[name]))
    assert manifest_problems(case) == []
    change(case)
    assert manifest_problems(case), case


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
        if file_line is not None:  # the planted line, or a list of right places that holds it
            assert case["planted"] in _places(file_line), case["name"]
        explains = case["expected"].get("explains", {})
        for place in _places(file_line) + _places(explains.get("site", [])) + [
                explains.get("generator", "").removeprefix("user:")] * ("generator" in explains):
            if place in ("torch_cpu", "python", "numpy"):
                continue
            script, _, line = place.partition(":")
            assert script == name and int(line) <= len((CORPUS / script).read_text().splitlines()), \
                f"{case['name']}: {place} is not a line of {name}"
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

def _run(argv, tmp_path, timeout=120, **variables):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAMEBITS_")}
    env.update(variables)
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


PLAIN = [c for c in CASES if c["setting"] == "plain loop" and c["samebits"][0] == "bisect"
         and "exit" not in c["expected"]]


@pytest.mark.slow
@pytest.mark.parametrize("case", PLAIN, ids=[c["name"] for c in PLAIN])
def test_plain_script_runs(case, tmp_path):
    proc = _run(bench.expand(case["run"], tmp_path) + ["--steps", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"step 2 loss \d", proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resume_data_position", "resume_lr_scheduler"])
def test_resume_script_saves_and_resumes(name, tmp_path):
    script = str(CORPUS / f"{name}.py")
    first = _run([sys.executable, script, "--ckpt", str(tmp_path / "a"), "--steps", "3"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _run([sys.executable, script, "--ckpt", str(tmp_path / "c"), "--steps", "3",
                    "--resume", str(tmp_path / "a" / "step1.pt")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.startswith("step 1 ") and "step 0 " not in resumed.stdout


GPT_SCRIPTS = sorted({c["planted"].partition(":")[0] for c in CASES if c["setting"] == "nanoGPT-style train.py"})
LOADER_SCRIPTS = sorted({c["planted"].partition(":")[0] for c in CASES if c["setting"] == "DataLoader loop"})


@pytest.mark.slow
@pytest.mark.parametrize("script", GPT_SCRIPTS)
def test_nanogpt_script_checkpoints_and_resumes(script, tmp_path):
    """Scratch with a checkpoint at iteration 1, then init_from = 'resume' from it."""
    path = str(CORPUS / script)
    # One hash seed for both: the set-ordered parameter groups of gpt_set_param_groups.py
    # would load A's optimizer state into other parameters (by position) in another process.
    hashing = {"PYTHONHASHSEED": "0"}
    first = _run([sys.executable, path, "--out", str(tmp_path / "a"), "--max-iters", "3", "--ckpt-at", "1"], tmp_path,
                 **hashing)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "iter 0: loss" in first.stdout and "iter 2: loss" in first.stdout and "step 0: train loss" in first.stdout
    assert (tmp_path / "a" / "ckpt.pt").exists()
    resumed = _run([sys.executable, path, "--out", str(tmp_path / "c"), "--max-iters", "3",
                    "--resume-from", str(tmp_path / "a")], tmp_path, **hashing)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "iter 0: loss" not in resumed.stdout or "iter_num" in script  # that one restarts at iteration 0
    assert "iter 2: loss" in resumed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", LOADER_SCRIPTS)
def test_loader_script_checkpoints_and_resumes(script, tmp_path):
    """Checkpoints every 2 steps, then a resume from step2.pt."""
    path = str(CORPUS / script)
    first = _run([sys.executable, path, "--out", str(tmp_path / "a"), "--steps", "3", "--ckpt-every", "2"], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    assert re.search(r"step 2 epoch 0 loss \d", first.stdout) and (tmp_path / "a" / "step2.pt").exists()
    resumed = _run([sys.executable, path, "--out", str(tmp_path / "c"), "--steps", "3",
                    "--resume", str(tmp_path / "a" / "step2.pt")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.startswith("step 2 ") and "step 1 " not in resumed.stdout


@pytest.mark.slow
def test_crash_script_crashes_after_clean_steps(tmp_path):
    proc = _run([sys.executable, str(CORPUS / "crash_mid_run.py")], tmp_path)
    assert proc.returncode != 0 and "IndexError" in proc.stderr
    assert "step 2 loss" in proc.stdout and "step 3 loss" not in proc.stdout


DDP = [c for c in CASES if c["setting"].startswith("DDP")]


@pytest.mark.slow
@pytest.mark.parametrize("case", DDP, ids=[c["name"] for c in DDP])
def test_ddp_script_runs_on_two_ranks(case, tmp_path):
    script = bench.expand(case["run"], tmp_path)[-1]
    proc = _run(TORCHRUN + [script, "--steps", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rank 0 step 1 loss" in proc.stdout and "rank 1 step 1 loss" in proc.stdout


@pytest.mark.slow
def test_hf_trainer_script_runs(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    case = BY_NAME["hf_trainer_collator"]
    proc = _run(bench.expand(case["run"], tmp_path) + ["--steps", "2"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'loss'" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_hf_trainer_resume_script_saves_and_resumes(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    script = str(CORPUS / "hf_trainer_resume_skip.py")
    first = _run([sys.executable, script, "--out", str(tmp_path / "a"), "--steps", "4"], tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (tmp_path / "a" / "checkpoint-4" / "rng_state.pth").exists()
    resumed = _run([sys.executable, script, "--out", str(tmp_path / "c"), "--steps", "5",
                    "--resume", str(tmp_path / "a" / "checkpoint-4")], tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (tmp_path / "c" / "checkpoint-5").exists()


@pytest.mark.slow
def test_lightning_script_saves_and_resumes(tmp_path):
    pytest.importorskip("lightning")
    script = str(CORPUS / "lightning_mid_epoch.py")
    first = _run([sys.executable, script, "--out", str(tmp_path / "a"), "--steps", "4"], tmp_path, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "rng" in torch.load(tmp_path / "a" / "step=4.ckpt", weights_only=False)  # the module's hook
    resumed = _run([sys.executable, script, "--out", str(tmp_path / "c"), "--steps", "5",
                    "--resume", str(tmp_path / "a" / "step=4.ckpt")], tmp_path, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming from a checkpoint that ended before the epoch ended" in resumed.stderr + resumed.stdout


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
    assert bench.judge(case, None, 2, "samebits bisect: error: ...")[0] == "crash"  # no verdict at all
    assert bench.judge(case, None, None, "")[0] == "miss"  # timeout


def test_matcher_classes():
    batch = BY_NAME["dataset_unseeded_random"]
    assert bench.judge(batch, _bisect("input_batch"), 1, "")[0] == "hit"
    assert bench.judge(batch, _bisect("op", site="/x/dataset_unseeded_random.py:99 in <module>"), 1, "")[0] == "wrong"
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
        return {"verdict": "fail", "checks": checks, "findings": [_finding("scheduler", step=3)]}
    assert bench.judge(resume, verify("identical", 4), 1, "")[0] == "hit"
    assert bench.judge(resume, verify("identical", 5), 1, "")[0] == "wrong"
    assert bench.judge(resume, verify("diverged", 4), 1, "")[0] == "wrong"
    assert bench.judge(resume, {"verdict": "pass", "checks": {}}, 0, "")[0] == "wrong"


def _verify(*, independent=("identical", None), resume=("diverged", 4), findings=None, verdict="fail"):
    def check(result):
        if result is None:  # not checked
            return None
        state, step = result
        return {"verdict": state, "first_divergence": None if step is None else {"step": step}}
    payload = {"verdict": verdict, "checks": {"independent": check(independent), "resume": check(resume)}}
    if findings is not None:
        payload["findings"] = findings
    return payload


def _finding(kind, *, check="resume", site=None, generator=None, step=4):
    return {"check": check, "kind": kind, "step": step, "rank": 0, "record": None, "says": f"{kind} ...",
            "site": site, "generator": generator}


def test_matcher_verify_explains():
    case = BY_NAME["gpt_resume_optimizer_state"]
    assert bench.judge(case, _verify(findings=[_finding("optimizer_state"), _finding("generator")]), 1, "")[0] \
        == "hit"
    assert bench.judge(case, _verify(findings=[_finding("generator"), _finding("optimizer_state")]), 1, "")[0] \
        == "wrong"  # another kind first
    assert bench.judge(case, _verify(findings=[]), 1, "")[0] == "miss"
    assert bench.judge(case, _verify(), 1, "")[0] == "miss"  # a samebits without findings
    assert bench.judge(case, _verify(findings=[_finding("optimizer_state", check="independent")]), 1, "")[0] \
        == "wrong"
    assert bench.judge(case, _verify(resume=("diverged", 5), findings=[_finding("optimizer_state")]), 1, "")[0] \
        == "wrong"  # the step decides first
    assert bench.judge(case, _verify(independent=("diverged", 0), findings=[_finding("optimizer_state")]), 1,
                       "")[0] == "wrong"
    assert bench.judge(case, _verify(verdict="pass", resume=("identical", None)), 0, "")[0] == "wrong"
    said = bench._said(_verify(findings=[_finding("optimizer_state")]))
    assert said == "optimizer_state ..."
    assert "finding: resume optimizer_state step 4" in bench.summarise(_verify(findings=[_finding("optimizer_state")]),
                                                                        1, "")


def test_matcher_verify_explains_site_and_generator():
    consumed = BY_NAME["loader_resume_iter_rng"]
    site = consumed["expected"]["explains"]["site"]
    line = int(site.partition(":")[2])
    hit = _finding("generator_consumed", site=f"/x/tests/corpus/{site}", generator="torch_cpu")
    assert bench.judge(consumed, _verify(findings=[hit]), 1, "")[0] == "hit"
    other = _finding("generator_consumed", site=f"loader_resume_iter_rng.py:{line + 1}")
    assert bench.judge(consumed, _verify(findings=[other]), 1, "")[0] == "wrong"
    assert bench.judge(consumed, _verify(findings=[_finding("generator_consumed")]), 1, "")[0] == "miss"
    private = BY_NAME["gpt_private_generator_verify"]
    creation = private["expected"]["explains"]["generator"]
    run = dict(independent=("diverged", 0), resume=None)
    good = _finding("generator", check="independent", generator=creation.replace("user:", "user:/x/corpus/"), step=0)
    assert bench.judge(private, _verify(**run, findings=[good]), 1, "")[0] == "hit"
    cpu = _finding("generator", check="independent", generator="torch_cpu", step=0)
    assert bench.judge(private, _verify(**run, findings=[cpu]), 1, "")[0] == "wrong"
    assert bench.judge(private, _verify(**run, findings=[_finding("generator", check="independent")]), 1, "")[0] \
        == "miss"
    assert bench.judge(private, _verify(independent=("identical", None), resume=None, findings=[good]), 0, "")[0] \
        == "wrong"
    assert bench.judge(private, _verify(independent=("diverged", 1), resume=None, findings=[good]), 1, "")[0] \
        == "wrong"
    assert bench.judge(private, _verify(independent=("diverged", 0), resume=None,
                                        findings=[_finding("input_batch", check="independent")]), 1, "")[0] == "wrong"


def test_matcher_private_generator_bisect():
    case = BY_NAME["gpt_private_generator_bisect"]
    creation = case["expected"]["origin"]["file_line"]
    named = f"generator torch.Generator made at /x/{creation} drew different numbers in aten::randint"
    assert bench.judge(case, _bisect("generator", conclusion=named), 1, "")[0] == "hit"
    assert bench.judge(case, _bisect("generator", conclusion="a private generator drew different numbers"), 1,
                       "")[0] == "hit"
    blamed = "torch CPU RNG state differs at step start: seeded from something that changes"
    assert bench.judge(case, _bisect("generator", conclusion=blamed), 1, "")[0] == "wrong"
    assert bench.judge(case, _bisect("generator", conclusion=named + "; " + blamed), 1, "")[0] == "miss"
    assert bench.judge(case, _bisect("generator", conclusion="aten::randint drew different numbers"), 1, "")[0] \
        == "miss"
    assert bench.judge(case, _bisect("input_batch"), 1, "")[0] == "miss"
    assert bench.judge(case, _bisect("op", site="/x/gpt_private_generator.py:70 in get_batch"), 1, "")[0] == "wrong"
    assert bench.judge(case, _bisect("generator", conclusion=named, step=1), 1, "")[0] == "wrong"


def test_matcher_file_line_alternatives():
    case = BY_NAME["gpt_set_param_groups_bisect"]
    places = case["expected"]["origin"]["file_line"]
    groups, clip = places[0], places[1]
    for place in places:
        assert bench.judge(case, _bisect("order", site=f"/x/{place} in <module>"), 1, "")[0] == "hit"
    script, _, line = clip.partition(":")
    assert bench.judge(case, _bisect("order", site=f"/x/{script}:{int(line) + 1} in <module>"), 1, "")[0] == "wrong"
    assert bench.judge(case, _bisect("order"), 1, "")[0] == "miss"
    clip_case = BY_NAME["gpt_clip_set_order"]  # no step expected: the orders may round alike at step 0
    at = f"/x/{clip_case['planted']} in <module>"
    assert bench.judge(clip_case, _bisect("order", site=at, step=3, phase="reduce"), 1, "")[0] == "hit"


# --- end to end through samebits (the fastest cases) ----------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["crash_mid_run_verify", "resume_data_position", "sampler_time_seed"])
def test_case_end_to_end(name):
    case = BY_NAME[name]  # the whole expectation, what explains a verdict included
    score = bench.run_case(case, timeout=240)
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
