"""Detection benchmark: run samebits on a corpus of planted faults and score what it says.

    python benchmarks/bench_detection.py                      # both corpora, a table each
    python benchmarks/bench_detection.py --corpus tests/corpus            # only the written-here corpus
    python benchmarks/bench_detection.py --corpus tests/realcode/hf       # one trainer of the real-code corpus
    python benchmarks/bench_detection.py --case set_param_order --case sampler_time_seed
    python benchmarks/bench_detection.py --timeout 300 --json > detection.json
    python benchmarks/bench_detection.py --from-json detection.json --markdown

Two corpora, scored and reported apart.  The written-here corpus (tests/corpus/cases.json):
each case is a small training script with one planted fault (tests/corpus/*.py, the line
marked `# PLANTED`).  The real-code corpus (tests/realcode/*/cases.json, one manifest per
trainer): installed trainers (HF Trainer, accelerate, torchtitan, Lightning, litgpt) run
through their own entry points, with the fault planted from outside (tests/realcode/README.md);
it also holds control cases, the unmodified run and its exact resume, that must PASS.  Each
case's samebits command runs with `--json`; its output is judged strictly against the case's
expectation (tests/corpus/README.md):

* hit    the verdict is right and the origin is the planted line or the expected class
         (verify: the right step and, where the case says what explains it, the right
         first finding);
* miss   the fault was not localised: no origin, a receiver/untraced finding, no finding, a
         run that could not be judged, a timeout;
* wrong  samebits named something else: another line, another step, another finding first,
         a verdict that contradicts the fault (PASS/IDENTICAL for a run that crashed or
         really differs; FAIL for a control case, a false alarm);
* crash  samebits gave no verdict because a run died under it or samebits itself failed
         (exit 2 with no JSON, or a run that did not end cleanly), where the case expects one.

Accuracy is hits over the cases that ran (a crash counts against it, as a miss does).
`--json` prints `scores` (each with its `corpus`), `totals` (every case printed), and, added
with the real-code corpus, `by_corpus` (totals per corpus label) and `realcode` (its total).

A benchmark, not a gate: it exits 0 whatever the score (2 only for bad arguments).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "corpus"
MANIFEST = CORPUS / "cases.json"
REALCODE = ROOT / "tests" / "realcode"  # one folder per trainer, each with its cases.json
WRITTEN_HERE = "written-here"

# The origin classes a case may expect, and the origin `kind` (bisect's JSON) that says each.
CLASS_KINDS = {
    "input batch": {"input_batch"},
    "generator:torch_cpu": {"generator"},
    "generator:user": {"generator"},
    "same values different order": {"order"},
    "collective order": {"order", "collective", "control_flow"},
    "replicas differ": {"replicas"},
    "initial state": {"initial_state"},  # initial weights that differ before step 0 (unseeded)
}
# How a conclusion names each generator.
GENERATORS = {
    "torch_cpu": re.compile(r"torch[ _.]?cpu", re.I),
    "torch_cuda": re.compile(r"torch[ _.]?cuda|cuda (rng|generator)", re.I),
    "python": re.compile(r"python `?random|rng\.python", re.I),
    "numpy": re.compile(r"numpy|np\.random", re.I),
}
# The generators whose state a census records for the whole process: a private generator's
# case must not blame them (their state is the same in both runs of such a script).
GLOBAL_GENERATORS = {
    "torch_cpu": re.compile(r"torch[ _.]?cpu (rng|random|generator) state|rng\.torch_cpu|global torch", re.I),
    "python": GENERATORS["python"],
    "numpy": GENERATORS["numpy"],
}
PRIVATE_GENERATOR = re.compile(r"private generator", re.I)
# The kinds of verify's findings (`--json` "findings", most specific first); a case's
# `explains` names one of them.
FINDING_KINDS = ("off_by_one", "model_params", "optimizer_state", "scheduler", "grad_scaler", "iteration_counter",
                 "data_position", "generator_consumed", "generator", "input_batch", "order", "script_said",
                 "initial_params")
# Kinds that claim where the difference comes from; any other kind (not_localised,
# below_dispatcher, receiver-style findings) is "not localised".
CLAIMS = {"op", "probe", "collective", "generator", "input_batch", "order", "initial_state", "replicas"}
CALL_SITE = re.compile(r"([^\s:/\\]+\.py):(\d+)")


@dataclass
class Score:
    name: str
    setting: str
    expected: str
    got: str
    outcome: str  # hit | miss | wrong | skipped
    why: str
    seconds: float
    exit_code: int | None
    said: str = ""  # samebits' own sentence: the origin's conclusion, or its error message
    corpus: str = WRITTEN_HERE  # "written-here", or "realcode/<trainer>" (the manifest's folder)


def load_cases(path: Path = MANIFEST) -> list[dict]:
    return json.loads(path.read_text())["cases"]


@dataclass
class Corpus:
    """One manifest: its label in the tables, the folder `{corpus}` stands for, its cases."""
    label: str
    folder: Path
    cases: list[dict]


def default_manifests() -> list[Path]:
    """The written-here corpus, then every real-code trainer's manifest."""
    return [MANIFEST, *sorted(REALCODE.glob("*/cases.json"))]


def corpus_label(manifest: Path) -> str:
    manifest = manifest.resolve()
    if manifest == MANIFEST.resolve():
        return WRITTEN_HERE
    if manifest.parent.parent == REALCODE.resolve():
        return f"realcode/{manifest.parent.name}"
    return str(manifest.parent)


def load_corpus(path: str | Path) -> Corpus:
    """A manifest given as its cases.json or as the folder holding it."""
    manifest = Path(path)
    if manifest.is_dir():
        manifest = manifest / "cases.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"no manifest at {manifest}: give a cases.json or the folder that holds one "
                                f"(tests/corpus, tests/realcode/<trainer>)")
    return Corpus(corpus_label(manifest), manifest.parent.resolve(), load_cases(manifest))


def _alternatives(value: str | list[str] | None) -> list[str]:
    """A `file_line`/`site` expectation: one `x.py:N`, or a list of places that are each right."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def describe_explains(explains: dict | list[dict] | None) -> str:
    if not explains:
        return ""
    if isinstance(explains, list):
        return "; explains: " + " or ".join(describe_explains(one).removeprefix("; explains: ") for one in explains)
    extra = [explains.get("generator"), " or ".join(_alternatives(explains.get("site"))) or None]
    return f"; explains: {' or '.join(_alternatives(explains['kind']))}" + "".join(f" {x}" for x in extra if x)


def describe_expected(case: dict) -> str:
    exp = case["expected"]
    if "exit" in exp:
        return f"exit {exp['exit']} (failed run), never PASS/identical"
    if exp.get("verdict") == "pass":
        return "PASS: every check identical (the unmodified trainer)"
    origin = exp.get("origin", {})
    if "resume_diverged_at" in exp:
        return (f"FAIL: A = B identical, resume diverged at step {exp['resume_diverged_at']}"
                + describe_explains(exp.get("explains")))
    if "independent_diverged_at" in exp:
        return (f"FAIL: A and B diverge at step {exp['independent_diverged_at']}"
                + describe_explains(exp.get("explains")))
    where = " + ".join(x for x in (origin.get("class"), " or ".join(_alternatives(origin.get("file_line")))) if x)
    at = f"step {exp['step']}" if "step" in exp else ""
    if "phase" in exp:
        at += f" {exp['phase']}"
    return f"{exp['verdict']}: {where}" + (f" ({at.strip()})" if at else "")


def expand(items: list[str], tmp: Path, corpus: Path = CORPUS) -> list[str]:
    subs = {"{python}": sys.executable, "{corpus}": str(corpus), "{tmp}": str(tmp)}
    out = []
    for item in items:
        for key, value in subs.items():
            item = item.replace(key, value)
        out.append(item)
    return out


def samebits_argv(case: dict, tmp: Path, corpus: Path = CORPUS) -> list[str]:
    """`python -m samebits SUBCOMMAND OPTIONS --json --out DIR -- RUN`."""
    command, *options = case["samebits"]
    argv = [sys.executable, "-m", "samebits", command, *expand(options, tmp, corpus), "--json",
            "--out", str(tmp / "out")]
    if case.get("run"):
        argv += ["--", *expand(case["run"], tmp, corpus)]
    return argv


def missing_requirements(case: dict) -> list[str]:
    return [name for name in case.get("requires", []) if importlib.util.find_spec(name) is None]


def _file_line(site: str | None) -> str | None:
    if not site:
        return None
    found = CALL_SITE.findall(site)
    return f"{found[-1][0]}:{found[-1][1]}" if found else None


def _first_line(text: str) -> str:
    """samebits' error line, else the first line that is not progress."""
    for line in text.splitlines():
        if "error:" in line:
            return line.strip()[:160]
    for line in text.splitlines():
        if line.strip() and not line.startswith("["):
            return line.strip()[:160]
    return text.strip()[:160]


def summarise(payload: dict | None, exit_code: int | None, stderr: str) -> str:
    """What samebits said, in one line."""
    if payload is None:
        return f"exit {exit_code}: {_first_line(stderr)}" if exit_code is not None else "timeout"
    if "checks" in payload:  # verify
        parts = [f"{payload['verdict'].upper()}"]
        for name, check in payload["checks"].items():
            if check is None:
                parts.append(f"{name}: not run")
            elif _identical(check):
                parts.append(f"{name}: identical")
            else:
                first = check.get("first_divergence") or {}
                parts.append(f"{name}: diverged at step {first.get('step')} ({first.get('phase')}/{first.get('name')})")
        findings = payload.get("findings")
        if findings:
            top = findings[0]
            detail = " ".join(str(x) for x in (top.get("generator"), top.get("site")) if x)
            parts.append(f"finding: {top.get('check')} {top.get('kind')} step {top.get('step')}"
                         + (f" ({detail})" if detail else ""))
        elif findings is not None:
            parts.append("no finding")
        return "; ".join(parts)
    origin = payload.get("origin")
    if origin is None:
        cf = payload.get("control_flow")
        return f"{payload.get('verdict')}; no origin" + (f"; control flow: {cf.get('detail', '')[:80]}" if cf else "")
    what = origin.get("op") or origin.get("id") or ""
    site = _file_line(origin.get("call_site")) or "no call site"
    return (f"{payload.get('verdict')}; {origin_kind(origin)} step {origin.get('step')} "
            f"{origin.get('phase')} {what} @ {site}")


def judge(case: dict, payload: dict | None, exit_code: int | None, stderr: str) -> tuple[str, str]:
    """(outcome, why) for one case."""
    exp = case["expected"]
    if exit_code is None:
        return "miss", "timed out"
    if "exit" in exp:  # a crashed run: only "could not run" is right
        if exit_code == exp["exit"]:
            return "hit", "reported the failed run"
        if exit_code == 0:
            return "wrong", "a good verdict (PASS/identical) for a run that crashed"
        return "wrong", f"a verdict (exit {exit_code}) for a run that crashed"
    crashed = crash_reason(payload, exit_code, stderr)
    if crashed:
        return "crash", crashed
    if exit_code not in (0, 1):
        return "miss", f"could not decide (exit {exit_code}, verdict {payload.get('verdict')})"
    if exp.get("verdict") == "pass":
        return _judge_control(payload)
    if "resume_diverged_at" in exp or "independent_diverged_at" in exp:
        return _judge_verify(exp, payload)
    return _judge_bisect(case, exp, payload)


def crash_reason(payload: dict | None, exit_code: int, stderr: str) -> str | None:
    """Why samebits gave no verdict where one was due: it printed none (a run died under it, or
    samebits raised), or a run it judged did not end cleanly; None when it judged normally."""
    if payload is None:
        return f"no verdict (exit {exit_code}): {_first_line(stderr)}"
    for run in payload.get("runs") or []:
        ended = str(run.get("ended", "finished"))
        if "crash" in ended or "exception" in ended:
            return f"run {run.get('name')} ended {ended[:100]} (exit {run.get('exit_code')})"
    return None


def _judge_control(payload: dict) -> tuple[str, str]:
    """A control case (the unmodified trainer, or its exact resume): only PASS is right."""
    verdict = str(payload.get("verdict", "")).lower()
    checks = {name: check for name, check in (payload.get("checks") or {}).items() if check is not None}
    if verdict == "pass" and checks and all(_identical(check) for check in checks.values()):
        return "hit", f"PASS ({', '.join(checks)} identical)"
    differ = [name for name, check in checks.items() if _identical(check) is False]
    if differ:
        return "wrong", f"a false alarm: {', '.join(differ)} reported different for the unmodified trainer"
    return "miss", f"verdict {verdict or '?'} without a difference"


def _identical(check: dict | None) -> bool | None:
    if check is None:
        return None
    if "identical" in check:
        return bool(check["identical"])
    return str(check.get("verdict", "")).lower() == "identical"


def _judge_verify(exp: dict, payload: dict) -> tuple[str, str]:
    checks = payload.get("checks", {})
    if "independent_diverged_at" in exp:  # the fault makes every run differ (no resume)
        if str(payload.get("verdict", "")).lower() == "pass":
            return "wrong", "PASS for runs that differ"
        independent = checks.get("independent")
        if independent is None:
            return "miss", "the independent runs were not compared"
        if _identical(independent):
            return "wrong", "independent runs reported identical; they differ"
        step = (independent.get("first_divergence") or {}).get("step")
        if step != exp["independent_diverged_at"]:
            return "wrong", f"A and B diverged at step {step}, expected {exp['independent_diverged_at']}"
        if "explains" in exp:
            return _judge_explains(exp["explains"], payload, "independent")
        return "hit", "A and B diverged at the step the fault acts"
    if str(payload.get("verdict", "")).lower() == "pass":
        return "wrong", "PASS for a resume that is not exact"
    if exp.get("independent") == "identical" and _identical(checks.get("independent")) is False:
        return "wrong", "claims independent runs differ; the script is repeatable"
    resume = checks.get("resume")
    if resume is None:
        return "miss", "the resume was not checked"
    if _identical(resume):
        return "wrong", "resume reported identical"
    step = (resume.get("first_divergence") or {}).get("step")
    if step != exp["resume_diverged_at"]:
        return "wrong", f"resume diverged at step {step}, expected {exp['resume_diverged_at']}"
    if "explains" in exp:
        return _judge_explains(exp["explains"], payload, "resume")
    return "hit", "resume diverged at the step the fault acts"


def _generator_name(value: str | None) -> str | None:
    """`torch_cpu`, `python`, `numpy` as they are; `user:<path>/x.py:N` as `user:x.py:N`."""
    if not value or not value.startswith("user:"):
        return value
    site = _file_line(value.removeprefix("user:"))
    return f"user:{site}" if site else value


def _judge_explains(want: dict | list[dict], payload: dict, check: str) -> tuple[str, str]:
    """The verdict and step are right; now the first finding must name the fault: its kind,
    and its site and generator where the case gives them.  `want` may be a list of such
    expectations, each of them right (a fault with several true answers): the first finding
    must meet one; judged by the one of its kind, when it meets none."""
    if isinstance(want, list):
        results = [_judge_explains(alternative, payload, check) for alternative in want]
        kind = ((payload.get("findings") or [{}])[0]).get("kind")
        same_kind = [r for alternative, r in zip(want, results) if kind in _alternatives(alternative["kind"])]
        return next((r for r in results if r[0] == "hit"), (same_kind or results)[0])
    findings = payload.get("findings")
    if not findings:
        return "miss", "verdict right, but no finding explains it"
    first = findings[0]
    kind = first.get("kind")
    if first.get("check") not in (None, check):
        return "wrong", f"the first finding ({kind}) is about the {first.get('check')} check, not the {check} one"
    if kind not in _alternatives(want["kind"]):  # a list where the fault has several true causes
        return "wrong", f"first finding {kind}, expected {' or '.join(_alternatives(want['kind']))}"
    if "site" in want:
        site = _file_line(first.get("site"))
        if site is None:
            return "miss", f"{kind} right, but no site (expected {' or '.join(_alternatives(want['site']))})"
        if site not in _alternatives(want["site"]):
            return "wrong", f"{kind} right, site {site}, expected {' or '.join(_alternatives(want['site']))}"
    if "generator" in want:
        named = _generator_name(first.get("generator"))
        if named is None:
            return "miss", f"{kind} right, but it names no generator (expected {want['generator']})"
        if named != want["generator"]:
            return "wrong", f"{kind} right, generator {named}, expected {want['generator']}"
    return "hit", f"{kind}" + (f" at {_file_line(first.get('site'))}" if "site" in want else "")


def origin_kind(origin: dict) -> str:
    """bisect's ``kind``; for output without it, what the classification implies."""
    if origin.get("kind"):
        return origin["kind"]
    if origin.get("classification") == "origin":
        return origin.get("category") or "op"
    return origin.get("classification") or "not_localised"


def _judge_bisect(case: dict, exp: dict, payload: dict) -> tuple[str, str]:
    verdict = str(payload.get("verdict", "")).lower()
    if verdict != exp["verdict"]:
        if case.get("runs_differ", True):
            return "wrong", f"verdict {verdict} but the runs differ"
        return "miss", f"verdict {verdict}: the fault repeats run to run and nothing compared the ranks"
    origin = payload.get("origin")
    if origin is None:
        return "miss", "not localised: no origin"
    want = exp["origin"]
    kind = origin_kind(origin)
    claims = kind in CLAIMS
    site = _file_line(origin.get("call_site"))
    if "step" in exp and origin.get("step") != exp["step"]:
        return ("wrong" if claims else "miss"), f"{kind} at step {origin.get('step')}, expected step {exp['step']}"
    if "class" in want:
        if kind not in CLASS_KINDS[want["class"]]:
            if want["class"] == "generator:user" and kind == "input_batch":
                return "miss", "input batch: the batch differs, but not the generator that drew it"
            if claims:
                return "wrong", f"{kind} {origin.get('op') or origin.get('id') or ''} @ {site}, not {want['class']}"
            return "miss", f"not localised ({kind}), not {want['class']}"
        if want["class"] == "generator:user":
            return _judge_private_generator(want, origin)
        if want["class"].startswith("generator:"):
            wanted = want["class"].partition(":")[2]
            named = [name for name, pattern in GENERATORS.items() if pattern.search(origin.get("conclusion") or "")]
            if not named:
                return "miss", f"generator, but the conclusion names none (expected {wanted})"
            if wanted not in named:
                return "wrong", f"the conclusion names {', '.join(named)}, not {wanted}"
            if len(named) > 1:
                return "miss", f"vague: the conclusion names {len(named)} generators ({', '.join(named)})"
        if "file_line" in want and site not in _alternatives(want["file_line"]):
            expected = " or ".join(_alternatives(want["file_line"]))
            return ("wrong" if site else "miss"), f"{kind} right, call site {site}, expected {expected}"
        if want["class"] == "collective order" and "order" not in (origin.get("conclusion") or "").lower():
            return "miss", f"{kind} at the planted call, but no word of the order"
        return "hit", want["class"]
    if not claims:
        return "miss", f"not localised ({kind})"
    if kind not in ("op", "probe", "collective"):
        return "wrong", f"{kind}, expected the op at {want['file_line']}"
    if site is None:
        return "miss", f"{kind} {origin.get('op') or origin.get('id')} without a call site"
    if site not in _alternatives(want["file_line"]):
        return "wrong", f"call site {site}, expected {' or '.join(_alternatives(want['file_line']))}"
    if "phase" in exp and origin.get("phase") != exp["phase"]:
        return "wrong", f"phase {origin.get('phase')}, expected {exp['phase']}"
    return "hit", "planted line"


def _judge_private_generator(want: dict, origin: dict) -> tuple[str, str]:
    """Kind `generator` for a private torch.Generator: the conclusion must name that generator,
    by its creation site (`x.py:N`, the case's `file_line`) or as a private generator, and
    no process-wide generator (their state is the same in both runs here)."""
    conclusion = origin.get("conclusion") or ""
    sites = {f"{name}:{line}" for name, line in CALL_SITE.findall(conclusion)}
    named_site = bool(sites & set(_alternatives(want.get("file_line"))))
    private = named_site or bool(PRIVATE_GENERATOR.search(conclusion))
    blamed = [name for name, pattern in GLOBAL_GENERATORS.items() if pattern.search(conclusion)]
    if private and blamed:
        return "miss", f"vague: the private generator and {', '.join(blamed)}"
    if private:
        return "hit", "generator:user" + (" (its creation site)" if named_site else " (a private generator)")
    if blamed:
        return "wrong", f"the conclusion blames {', '.join(blamed)}, not the private generator"
    return "miss", "generator, but the conclusion names neither the private generator nor its creation site"


def run_case(case: dict, *, timeout: float, keep: Path | None = None, corpus: Path = CORPUS,
             label: str = WRITTEN_HERE) -> Score:
    missing = missing_requirements(case)
    if missing:
        return Score(case["name"], case["setting"], describe_expected(case), "-", "skipped",
                     f"not installed: {', '.join(missing)}", 0.0, None, corpus=label)
    tmp = Path(tempfile.mkdtemp(prefix=f"corpus-{case['name']}-"))
    argv = samebits_argv(case, tmp, corpus)
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)  # the set-order faults need each process to draw its own
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=tmp, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        exit_code = process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # samebits and every run it started
        stdout, stderr = process.communicate()
        exit_code = None
    seconds = time.perf_counter() - start
    try:
        payload = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        payload = None
    outcome, why = judge(case, payload, exit_code, stderr)
    got = summarise(payload, exit_code, stderr)
    said = _said(payload)
    if payload is None:
        said = _first_line(stderr) if exit_code is not None else f"killed after {timeout:.0f} s"
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{case['name']}.json").write_text(json.dumps(
            {"argv": argv, "exit": exit_code, "stdout": stdout, "stderr": stderr[-20000:], "seconds": seconds},
            indent=1))
    shutil.rmtree(tmp, ignore_errors=True)
    return Score(case["name"], case["setting"], describe_expected(case), got, outcome, why, seconds, exit_code,
                 said, corpus=label)


def _said(payload: dict | None) -> str:
    """samebits' own sentence: bisect's conclusion, or verify's first finding."""
    payload = payload or {}
    findings = payload.get("findings") or [{}]
    return ((payload.get("origin") or {}).get("conclusion") or payload.get("conclusion")
            or findings[0].get("says") or "")


def rejudge(case: dict, kept: Path, label: str = WRITTEN_HERE) -> Score:
    """Score a case again from the raw output that ``--keep`` saved (after a matcher change)."""
    raw = json.loads((kept / f"{case['name']}.json").read_text())
    try:
        payload = json.loads(raw["stdout"]) if raw["stdout"].strip() else None
    except json.JSONDecodeError:
        payload = None
    outcome, why = judge(case, payload, raw["exit"], raw["stderr"])
    said = _said(payload)
    if payload is None:
        said = _first_line(raw["stderr"]) if raw["exit"] is not None else "killed (timeout)"
    return Score(case["name"], case["setting"], describe_expected(case), summarise(payload, raw["exit"], raw["stderr"]),
                 outcome, why, raw.get("seconds", 0.0), raw["exit"], said, corpus=label)


def _table(scores: list[Score]) -> str:
    rows = [["case", "expected", "got", "result", "s"]]
    for s in scores:
        rows.append([s.name, s.expected, s.got, f"{s.outcome.upper()}: {s.why}", f"{s.seconds:.0f}"])
    widths = [min(max(len(r[i]) for r in rows), 70) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        lines.append(" | ".join(cell[:70].ljust(w) for cell, w in zip(r, widths)))
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _grouped(scores: list[Score]) -> dict[str, list[Score]]:
    """Scores by corpus, the written-here corpus first, then the trainers in name order."""
    labels = sorted({s.corpus for s in scores}, key=lambda label: (label != WRITTEN_HERE, label))
    return {label: [s for s in scores if s.corpus == label] for label in labels}


def render(scores: list[Score]) -> str:
    """A table per corpus with its totals; with several corpora, the per-corpus summary last."""
    groups = _grouped(scores)
    if len(groups) <= 1:
        return _table(scores) + "\n\n" + totals_line(totals(scores))
    parts = [f"== {label} ==\n{_table(group)}\n\n{totals_line(totals(group))}" for label, group in groups.items()]
    return "\n\n".join(parts) + "\n\n" + render_summary(scores)


def render_summary(scores: list[Score], markdown: bool = False) -> str:
    """Per corpus (the real-code one per trainer): right/miss/wrong/crash and the accuracy, the
    real-code corpus's total apart from the written-here one."""
    rows = [[label, *_summary_cells(totals(group))] for label, group in _grouped(scores).items()]
    realcode = [s for s in scores if s.corpus != WRITTEN_HERE]
    if len({s.corpus for s in realcode}) > 1:
        rows.append(["realcode (all trainers)", *_summary_cells(totals(realcode))])
    header = ["corpus", "cases", "right", "miss", "wrong", "crash", "skipped", "accuracy"]
    if markdown:
        return "\n".join("| " + " | ".join(r) + " |" for r in [header, ["---"] + ["---:"] * 7, *rows])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _summary_cells(t: dict) -> list[str]:
    accuracy = f"{100 * t['accuracy']:.0f}%" if t["accuracy"] is not None else "-"
    return [str(t["cases"]), str(t["hit"]), str(t["miss"]), str(t["wrong"]), str(t["crash"]), str(t["skipped"]),
            accuracy]


def render_markdown(scores: list[Score]) -> str:
    """The same tables for benchmarks/RESULTS.md."""
    groups = _grouped(scores)
    parts = []
    for label, group in groups.items():
        lines = ["| case | setting | expected | samebits said | result | s |", "|---|---|---|---|---|---:|"]
        for s in group:
            cells = [s.name, s.setting, s.expected, s.got, f"**{s.outcome}**: {s.why}", f"{s.seconds:.0f}"]
            lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
        table = "\n".join(lines) + "\n\n" + totals_line(totals(group))
        parts.append(table if len(groups) == 1 else f"#### {label}\n\n{table}")
    if len(groups) > 1:
        parts.append(render_summary(scores, markdown=True))
    return "\n\n".join(parts)


def totals(scores: list[Score]) -> dict:
    ran = [s for s in scores if s.outcome != "skipped"]
    count = {k: sum(s.outcome == k for s in ran) for k in ("hit", "miss", "wrong", "crash")}
    return {"cases": len(scores), "ran": len(ran), **count,
            "skipped": len(scores) - len(ran),
            "accuracy": round(count["hit"] / len(ran), 3) if ran else None,
            "seconds_per_case": round(sum(s.seconds for s in ran) / len(ran), 1) if ran else None,
            "max_seconds": round(max((s.seconds for s in ran), default=0.0), 1)}


def totals_by_corpus(scores: list[Score]) -> dict:
    return {label: totals(group) for label, group in _grouped(scores).items()}


def totals_line(t: dict) -> str:
    if not t["ran"]:
        return "no case ran"
    return (f"localisation accuracy {t['hit']}/{t['ran']} = {100 * t['accuracy']:.0f}% "
            f"(miss {t['miss']}, wrong {t['wrong']}, crash {t.get('crash', 0)}, skipped {t['skipped']}); "
            f"{t['seconds_per_case']:.0f} s per case on average, slowest {t['max_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="append", default=[], metavar="PATH",
                        help="a manifest (cases.json, or the folder holding it) to run, repeatable; default: "
                             "tests/corpus and every tests/realcode/*/cases.json, reported apart")
    parser.add_argument("--case", action="append", default=[], metavar="NAME", help="run only this case (repeatable)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case before it counts as a miss")
    parser.add_argument("--keep", default=None, help="folder for each case's raw samebits output")
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--rejudge", default=None, metavar="DIR",
                        help="score the raw outputs a previous --keep DIR saved, without running anything")
    parser.add_argument("--from-json", default=None, metavar="FILE",
                        help="print the table of a previous --json output instead of running")
    args = parser.parse_args(argv)
    if args.from_json:
        saved = [Score(**row) for row in json.loads(Path(args.from_json).read_text())["scores"]]
        print(render_markdown(saved) if args.markdown else render(saved))
        return 0
    try:
        corpora = [load_corpus(path) for path in (args.corpus or default_manifests())]
    except FileNotFoundError as err:
        print(f"bench_detection: --corpus: {err}", file=sys.stderr)
        return 2
    names = [c["name"] for corpus in corpora for c in corpus.cases]
    unknown = [n for n in args.case if n not in names]
    if unknown:
        print(f"bench_detection: unknown case(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}",
              file=sys.stderr)
        return 2
    todo = [(corpus, case) for corpus in corpora for case in corpus.cases if not args.case or case["name"] in args.case]
    scores = []
    if args.rejudge:
        kept = Path(args.rejudge)
        scores = [rejudge(case, kept, corpus.label) for corpus, case in todo if (kept / f"{case['name']}.json").exists()]
        todo = []
    for index, (corpus, case) in enumerate(todo, 1):
        print(f"[{index}/{len(todo)}] {corpus.label}: {case['name']} ...", file=sys.stderr, flush=True)
        score = run_case(case, timeout=args.timeout, keep=Path(args.keep) if args.keep else None,
                         corpus=corpus.folder, label=corpus.label)
        print(f"      {score.outcome.upper()} in {score.seconds:.0f} s: {score.why}", file=sys.stderr, flush=True)
        scores.append(score)
    if args.json:
        realcode = [s for s in scores if s.corpus != WRITTEN_HERE]
        print(json.dumps({"scores": [asdict(s) for s in scores], "totals": totals(scores),
                          "by_corpus": totals_by_corpus(scores),
                          "realcode": totals(realcode) if realcode else None}, indent=1))
    elif args.markdown:
        print(render_markdown(scores))
    else:
        print(render(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
