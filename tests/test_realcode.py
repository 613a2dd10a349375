"""The real-code corpus (tests/realcode/<trainer>/cases.json): every manifest well formed in the
schema of tests/corpus/cases.json (plus control cases that must PASS), its PLANTED markers
where it says, the benchmark's real-code scoring and tables, and a few cases end to end through
the installed trainers."""

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
REALCODE = ROOT / "tests" / "realcode"
# The written-here corpus's manifest check is the schema; load it without collecting its tests here.
_SPEC = importlib.util.spec_from_file_location("_corpus_checks", ROOT / "tests" / "test_corpus.py")
corpus_checks = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(corpus_checks)
bench = corpus_checks.bench

MANIFESTS = sorted(REALCODE.glob("*/cases.json"))
CORPORA = {m.parent.name: bench.load_corpus(m) for m in MANIFESTS}
BY_NAME = {case["name"]: (corpus, case) for corpus in CORPORA.values() for case in corpus.cases}
MINE = ("hf", "accelerate")  # the trainers whose files this module's end-to-end tests know


def _is_control(case: dict) -> bool:
    return case.get("expected") == {"verdict": "pass"}


def realcode_problems(case: dict, folder: Path) -> list[str]:
    """What is wrong with one real-code case ([] for a well-formed one): a control case (the
    unmodified trainer, verify, expected PASS, nothing planted) or a fault case in the corpus
    schema, where `explains.kind` may list the kinds of a fault with several true causes and
    `explains` may list whole alternatives (each right)."""
    name = case.get("name", "?")
    if _is_control(case):
        problems = []
        if set(case) - {"name", "setting", "fault", "samebits", "run", "expected", "requires"}:
            problems.append("a control case has no planted line (unknown fields)")
        if (case.get("samebits") or ["?"])[0] != "verify":
            problems.append("a control case runs verify")
        if not case.get("run") or not case.get("setting") or not case.get("fault"):
            problems.append("run, fault and setting are required")
        return [f"{name}: {p}" for p in problems]
    case = json.loads(json.dumps(case))
    expected = case.get("expected", {})
    problems = []
    if isinstance(expected.get("explains"), list):  # alternatives: check each, then the case with the first
        if not expected["explains"]:
            problems.append(f"{name}: explains lists no alternative")
        for alternative in expected["explains"][1:]:
            problems += [f"{name}: {p}" for p in corpus_checks._explains_problems(alternative)]
        expected["explains"] = (expected["explains"] or [None])[0]
    explains = expected.get("explains")
    if isinstance(explains, dict) and isinstance(explains.get("kind"), list):
        kinds = explains["kind"]
        if not kinds or not all(k in bench.FINDING_KINDS for k in kinds):
            problems.append(f"{name}: explains kind {kinds} must be verify finding kinds")
        explains["kind"] = kinds[0] if kinds else None
    problems += corpus_checks.manifest_problems(case)
    planted = case.get("planted", "")
    if planted and not (folder / planted.partition(":")[0]).is_file():
        problems.append(f"{name}: {planted} is not a file of {folder.name}/")
    return problems


def _marked_lines(script: Path) -> list[int]:
    return [n for n, line in enumerate(script.read_text().splitlines(), 1) if "# PLANTED" in line]


# --- the manifests --------------------------------------------------------------------------

def test_the_corpus_holds_hf_and_accelerate():
    assert set(MINE) <= set(CORPORA), f"manifests found: {sorted(CORPORA)}"


@pytest.mark.parametrize("trainer", sorted(CORPORA))
def test_manifest_is_well_formed(trainer):
    corpus = CORPORA[trainer]
    assert corpus.label == f"realcode/{trainer}"
    assert [p for case in corpus.cases for p in realcode_problems(case, corpus.folder)] == []
    controls = [c for c in corpus.cases if _is_control(c)]
    assert any("--resume-with" in c["samebits"] for c in controls), "a control case checks the exact resume"
    assert len(corpus.cases) - len(controls) >= 4, "at least 4 planted faults per trainer"


def test_case_names_are_unique_across_every_corpus():
    names = [c["name"] for c in bench.load_cases()] + [c["name"] for corpus in CORPORA.values() for c in corpus.cases]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


@pytest.mark.parametrize("change", [
    lambda c: c.update(planted="train.py:1"),                                  # nothing is planted in a control
    lambda c: c.update(samebits=["bisect"]),                                   # a control is a verify
    lambda c: c["expected"].update(resume_diverged_at=4),                      # not a control any more, half a fault
])
def test_control_check_rejects_malformed_controls(change):
    corpus, case = BY_NAME["hf_unmodified"]
    case = json.loads(json.dumps(case))
    assert realcode_problems(case, corpus.folder) == []
    change(case)
    assert realcode_problems(case, corpus.folder), case


@pytest.mark.parametrize("change", [
    lambda e: e["explains"].update(kind=[]),
    lambda e: e["explains"].update(kind=["optimizer_state", "optimizer"]),
    lambda e: e["explains"].update(kind="lr"),
])
def test_fault_check_rejects_unknown_kinds(change):
    corpus, case = BY_NAME["hf_save_only_model"]
    case = json.loads(json.dumps(case))
    assert realcode_problems(case, corpus.folder) == []
    change(case["expected"])
    assert realcode_problems(case, corpus.folder), case["expected"]


@pytest.mark.parametrize("trainer", sorted(CORPORA))
def test_planted_markers_match_the_manifest(trainer):
    corpus = CORPORA[trainer]
    claimed = set()
    for case in corpus.cases:
        if _is_control(case):
            continue
        script, _, line = case["planted"].partition(":")
        assert int(line) in _marked_lines(corpus.folder / script), f"{case['name']}: {case['planted']} has no # PLANTED"
        claimed.add((script, int(line)))
        file_line = case["expected"].get("origin", {}).get("file_line")
        if file_line is not None:
            assert case["planted"] in corpus_checks._places(file_line), case["name"]
    marked = {(p.name, n) for p in corpus.folder.glob("*.py") for n in _marked_lines(p)}
    assert marked == claimed, f"PLANTED lines no case names: {sorted(marked - claimed)}"


@pytest.mark.parametrize("trainer", MINE)
def test_every_fault_wrapper_is_a_case_and_plants_one_line(trainer):
    corpus = CORPORA[trainer]
    wrappers = sorted(p.name for p in corpus.folder.glob("fault_*.py"))
    used = {c["planted"].partition(":")[0] for c in corpus.cases if not _is_control(c)}
    assert wrappers and set(wrappers) == used
    for name in wrappers:
        assert len(_marked_lines(corpus.folder / name)) == 1, name
    assert not _marked_lines(corpus.folder / "train.py"), "the unmodified launcher plants nothing"


def test_corpus_placeholder_is_the_manifests_folder(tmp_path):
    corpus, case = BY_NAME["hf_ignore_data_skip"]
    argv = bench.samebits_argv(case, tmp_path, corpus.folder)
    resume_with = argv[argv.index("--resume-with") + 1]
    assert str(REALCODE / "hf" / "fault_ignore_data_skip.py") in resume_with
    assert argv[argv.index("--") + 2] == str(REALCODE / "hf" / "fault_ignore_data_skip.py")
    assert not any("{corpus}" in a or "{python}" in a for a in argv)


# --- the benchmark's judging and tables -------------------------------------------------------

def _verify(verdict="pass", *, independent=None, resume=None, findings=None, runs=None):
    def check(state):
        if state is None:
            return {"verdict": "identical", "first_divergence": None}
        return {"verdict": "diverged", "first_divergence": {"step": state, "phase": "params", "name": "w"}}
    payload = {"verdict": verdict, "checks": {"independent": check(independent), "resume": check(resume)},
               "runs": runs or [{"name": "A", "exit_code": 0, "ended": "finished"}]}
    if findings is not None:
        payload["findings"] = findings
    return payload


def test_control_case_is_judged_pass_only():
    _, case = BY_NAME["hf_unmodified"]
    assert bench.judge(case, _verify(), 0, "")[0] == "hit"
    assert bench.judge(case, _verify("fail", resume=4), 1, "")[0] == "wrong"  # a false alarm
    assert bench.judge(case, _verify("fail", independent=0), 1, "")[0] == "wrong"
    assert bench.judge(case, None, 2, "samebits verify: error: run A failed")[0] == "crash"
    died = [{"name": "C (resume)", "exit_code": 1, "ended": "crashed at teardown (SIGSEGV)"}]
    assert bench.judge(case, _verify(runs=died), 0, "")[0] == "crash"
    assert bench.judge(case, _verify("incomplete"), 2, "")[0] == "miss"  # gaps: an honest "cannot say"
    assert bench.judge(case, None, None, "")[0] == "miss"  # timed out
    assert "PASS" in bench.describe_expected(case)


def test_fault_with_several_true_causes_accepts_each():
    _, case = BY_NAME["hf_save_only_model"]
    for kind in case["expected"]["explains"]["kind"]:
        found = [{"check": "resume", "kind": kind, "step": 4}]
        assert bench.judge(case, _verify("fail", resume=4, findings=found), 1, "")[0] == "hit", kind
    wrong = [{"check": "resume", "kind": "data_position", "step": 4}]
    assert bench.judge(case, _verify("fail", resume=4, findings=wrong), 1, "")[0] == "wrong"
    assert " or " in bench.describe_expected(case)


def test_explains_alternatives_each_right():
    _, case = BY_NAME["hf_collator_numpy"]
    creation = case["expected"]["explains"][1]["generator"]
    batch = [{"check": "independent", "kind": "input_batch", "step": 0}]
    named = [{"check": "independent", "kind": "generator", "step": 0, "generator": creation.replace(":", ":/x/", 1)}]
    cpu = [{"check": "independent", "kind": "generator", "step": 0, "generator": "torch_cpu"}]
    order = [{"check": "independent", "kind": "order", "step": 0}]
    judged = {name: bench.judge(case, _verify("fail", independent=0, findings=found), 1, "")[0]
              for name, found in [("batch", batch), ("named", named), ("cpu", cpu), ("order", order)]}
    assert judged == {"batch": "hit", "named": "hit", "cpu": "wrong", "order": "wrong"}
    assert "input_batch or generator user:" in bench.describe_expected(case)
    for change in (lambda e: e.update(explains=[]), lambda e: e["explains"][1].update(kind="rng")):
        broken = json.loads(json.dumps(case))
        change(broken["expected"])
        assert realcode_problems(broken, REALCODE / "hf"), broken["expected"]


def _score(name, outcome, corpus):
    return bench.Score(name, "s", "exp", "got", outcome, "why", 5.0, 1, corpus=corpus)


def test_tables_report_the_real_code_corpus_apart(tmp_path, capsys):
    scores = [_score("a", "hit", "written-here"), _score("b", "miss", "written-here"),
              _score("h1", "hit", "realcode/hf"), _score("h2", "crash", "realcode/hf"),
              _score("x1", "wrong", "realcode/accelerate"), _score("x2", "skipped", "realcode/accelerate")]
    text = bench.render(scores)
    assert text.index("== written-here ==") < text.index("== realcode/accelerate ==") < text.index("== realcode/hf ==")
    summary = text.rsplit("\n\n", 1)[1].splitlines()
    assert [c.strip() for c in summary[0].split("|")] == ["corpus", "cases", "right", "miss", "wrong", "crash",
                                                          "skipped", "accuracy"]
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]] for line in summary[2:]}
    assert rows["realcode/hf"] == ["2", "1", "0", "0", "1", "0", "50%"]
    assert rows["realcode/accelerate"] == ["2", "0", "0", "1", "0", "1", "0%"]
    assert rows["written-here"] == ["2", "1", "1", "0", "0", "0", "50%"]
    assert rows["realcode (all trainers)"] == ["4", "1", "0", "1", "1", "1", "33%"]
    by_corpus = bench.totals_by_corpus(scores)
    assert by_corpus["realcode/hf"]["crash"] == 1 and by_corpus["written-here"]["accuracy"] == 0.5
    assert "crash 1" in bench.totals_line(by_corpus["realcode/hf"])
    markdown = bench.render_markdown(scores)
    assert "#### realcode/hf" in markdown and "| realcode/hf | 2 | 1 | 0 | 0 | 1 | 0 | 50% |" in markdown
    saved = tmp_path / "scores.json"  # an old --json output (no corpus field) still renders
    saved.write_text(json.dumps({"scores": [{k: v for k, v in bench.asdict(s).items() if k != "corpus"}
                                            for s in scores[:2]]}))
    assert bench.main(["--from-json", str(saved)]) == 0
    assert "written-here" not in capsys.readouterr().out.split("\n")[0]


def test_corpus_option(tmp_path, capsys):
    assert bench.main(["--corpus", str(tmp_path / "none"), "--case", "x"]) == 2
    assert "no manifest" in capsys.readouterr().err
    # a case of another corpus is unknown to the one given
    assert bench.main(["--corpus", str(REALCODE / "hf"), "--case", "accelerate_unmodified"]) == 2
    assert [m.name for m in bench.default_manifests()][0] == "cases.json"
    assert bench.default_manifests()[0] == bench.MANIFEST and set(MANIFESTS) <= set(bench.default_manifests())


def test_rejudge_keeps_the_corpus_label(tmp_path):
    corpus, case = BY_NAME["accelerate_unmodified"]
    raw = {"argv": [], "exit": 0, "stdout": json.dumps(_verify()), "stderr": "", "seconds": 3.0}
    (tmp_path / f"{case['name']}.json").write_text(json.dumps(raw))
    score = bench.rejudge(case, tmp_path, corpus.label)
    assert (score.outcome, score.corpus) == ("hit", "realcode/accelerate")


# --- the trainers run (installed, through their own entry points) ----------------------------

def _run(argv, cwd, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAMEBITS_")}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_accelerate_loop_resumes_exactly_without_samebits(tmp_path):
    """The user's loop (load_state + skip_first_batches) resumes bit for bit: the same losses."""
    pytest.importorskip("accelerate")
    script = str(REALCODE / "accelerate" / "train.py")
    first = _run([sys.executable, script, "--out", str(tmp_path / "a"), "--steps", "6"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _run([sys.executable, script, "--out", str(tmp_path / "c"), "--steps", "6",
                    "--resume", str(tmp_path / "a" / "step_4")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = re.findall(r"step (\d+) loss (\S+)", first.stdout)
    assert len(losses) == 6 and re.findall(r"step (\d+) loss (\S+)", resumed.stdout) == losses[4:]


# The unmodified controls run as docs/integrations.md shows them (tests/test_docs_realcode.py).
E2E = ["hf_ignore_data_skip", "accelerate_skip_forgotten"]


@pytest.mark.slow
@pytest.mark.parametrize("name", E2E)
def test_case_end_to_end(name):
    corpus, case = BY_NAME[name]
    missing = bench.missing_requirements(case)
    if missing:
        pytest.skip(f"not installed: {missing}")
    score = bench.run_case(case, timeout=900, corpus=corpus.folder, label=corpus.label)
    assert score.outcome == "hit", (score.got, score.why, score.said)
