"""Detection benchmark: run samebits on a corpus of planted faults and score what it says.

    python benchmarks/bench_detection.py                      # every case in tests/corpus/cases.json
    python benchmarks/bench_detection.py --case set_param_order --case sampler_time_seed
    python benchmarks/bench_detection.py --timeout 300 --json > detection.json
    python benchmarks/bench_detection.py --from-json detection.json --markdown

Each case is a small training script with one planted fault (tests/corpus/*.py, the line
marked `# PLANTED`) and the samebits command that should find it.  The command runs with
`--json`; its output is judged strictly against the case's expectation (tests/corpus/README.md):

* hit    the verdict is right and the origin is the planted line or the expected class
         (verify: the right step and, where the case says what explains it, the right
         first finding);
* miss   the fault was not localised: no origin, a receiver/untraced finding, no finding, a
         run that could not be judged, a timeout;
* wrong  samebits named something else: another line, another step, another finding first,
         a verdict that contradicts the fault (PASS/IDENTICAL for a run that crashed or
         really differs).

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

CORPUS = Path(__file__).resolve().parent.parent / "tests" / "corpus"
MANIFEST = CORPUS / "cases.json"

# The origin classes a case may expect, and the origin `kind` (bisect's JSON) that says each.
CLASS_KINDS = {
    "input batch": {"input_batch"},
    "generator:torch_cpu": {"generator"},
    "generator:user": {"generator"},
    "same values different order": {"order"},
    "collective order": {"order", "collective", "control_flow"},
    "replicas differ": {"replicas"},
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
                 "data_position", "generator_consumed", "generator", "input_batch", "order", "script_said")
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


def load_cases(path: Path = MANIFEST) -> list[dict]:
    return json.loads(path.read_text())["cases"]


def _alternatives(value: str | list[str] | None) -> list[str]:
    """A `file_line`/`site` expectation: one `x.py:N`, or a list of places that are each right."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def describe_explains(explains: dict | None) -> str:
    if not explains:
        return ""
    extra = [explains.get("generator"), " or ".join(_alternatives(explains.get("site"))) or None]
    return f"; explains: {explains['kind']}" + "".join(f" {x}" for x in extra if x)


def describe_expected(case: dict) -> str:
    exp = case["expected"]
    if "exit" in exp:
        return f"exit {exp['exit']} (failed run), never PASS/identical"
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


def expand(items: list[str], tmp: Path) -> list[str]:
    subs = {"{python}": sys.executable, "{corpus}": str(CORPUS), "{tmp}": str(tmp)}
    out = []
    for item in items:
        for key, value in subs.items():
            item = item.replace(key, value)
        out.append(item)
    return out


def samebits_argv(case: dict, tmp: Path) -> list[str]:
    """`python -m samebits SUBCOMMAND OPTIONS --json --out DIR -- RUN`."""
    command, *options = case["samebits"]
    argv = [sys.executable, "-m", "samebits", command, *expand(options, tmp), "--json", "--out", str(tmp / "out")]
    if case.get("run"):
        argv += ["--", *expand(case["run"], tmp)]
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
    if exit_code not in (0, 1) or payload is None:
        return "miss", f"could not run (exit {exit_code})"
    if "resume_diverged_at" in exp or "independent_diverged_at" in exp:
        return _judge_verify(exp, payload)
    return _judge_bisect(case, exp, payload)


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


def _judge_explains(want: dict, payload: dict, check: str) -> tuple[str, str]:
    """The verdict and step are right; now the first finding must name the fault: its kind,
    and its site and generator where the case gives them."""
    findings = payload.get("findings")
    if not findings:
        return "miss", "verdict right, but no finding explains it"
    first = findings[0]
    kind = first.get("kind")
    if first.get("check") not in (None, check):
        return "wrong", f"the first finding ({kind}) is about the {first.get('check')} check, not the {check} one"
    if kind != want["kind"]:
        return "wrong", f"first finding {kind}, expected {want['kind']}"
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


def run_case(case: dict, *, timeout: float, keep: Path | None = None) -> Score:
    missing = missing_requirements(case)
    if missing:
        return Score(case["name"], case["setting"], describe_expected(case), "-", "skipped",
                     f"not installed: {', '.join(missing)}", 0.0, None)
    tmp = Path(tempfile.mkdtemp(prefix=f"corpus-{case['name']}-"))
    argv = samebits_argv(case, tmp)
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
                 said)


def _said(payload: dict | None) -> str:
    """samebits' own sentence: bisect's conclusion, or verify's first finding."""
    payload = payload or {}
    findings = payload.get("findings") or [{}]
    return ((payload.get("origin") or {}).get("conclusion") or payload.get("conclusion")
            or findings[0].get("says") or "")


def rejudge(case: dict, kept: Path) -> Score:
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
                 outcome, why, raw.get("seconds", 0.0), raw["exit"], said)


def render(scores: list[Score]) -> str:
    rows = [["case", "expected", "got", "result", "s"]]
    for s in scores:
        rows.append([s.name, s.expected, s.got, f"{s.outcome.upper()}: {s.why}", f"{s.seconds:.0f}"])
    widths = [min(max(len(r[i]) for r in rows), 70) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        lines.append(" | ".join(cell[:70].ljust(w) for cell, w in zip(r, widths)))
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines) + "\n\n" + totals_line(totals(scores))


def render_markdown(scores: list[Score]) -> str:
    """The same table for benchmarks/RESULTS.md."""
    lines = ["| case | setting | expected | samebits said | result | s |", "|---|---|---|---|---|---:|"]
    for s in scores:
        cells = [s.name, s.setting, s.expected, s.got, f"**{s.outcome}**: {s.why}", f"{s.seconds:.0f}"]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines) + "\n\n" + totals_line(totals(scores))


def totals(scores: list[Score]) -> dict:
    ran = [s for s in scores if s.outcome != "skipped"]
    count = {k: sum(s.outcome == k for s in ran) for k in ("hit", "miss", "wrong")}
    return {"cases": len(scores), "ran": len(ran), **count,
            "skipped": len(scores) - len(ran),
            "accuracy": round(count["hit"] / len(ran), 3) if ran else None,
            "seconds_per_case": round(sum(s.seconds for s in ran) / len(ran), 1) if ran else None,
            "max_seconds": round(max((s.seconds for s in ran), default=0.0), 1)}


def totals_line(t: dict) -> str:
    if not t["ran"]:
        return "no case ran"
    return (f"localisation accuracy {t['hit']}/{t['ran']} = {100 * t['accuracy']:.0f}% "
            f"(miss {t['miss']}, wrong {t['wrong']}, skipped {t['skipped']}); "
            f"{t['seconds_per_case']:.0f} s per case on average, slowest {t['max_seconds']:.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    cases = load_cases()
    names = {c["name"] for c in cases}
    unknown = [n for n in args.case if n not in names]
    if unknown:
        print(f"bench_detection: unknown case(s) {', '.join(unknown)}; known: {', '.join(sorted(names))}",
              file=sys.stderr)
        return 2
    if args.case:
        cases = [c for c in cases if c["name"] in args.case]
    scores = []
    if args.rejudge:
        scores = [rejudge(case, Path(args.rejudge)) for case in cases
                  if (Path(args.rejudge) / f"{case['name']}.json").exists()]
        cases = []
    for index, case in enumerate(cases, 1):
        print(f"[{index}/{len(cases)}] {case['name']} ...", file=sys.stderr, flush=True)
        score = run_case(case, timeout=args.timeout, keep=Path(args.keep) if args.keep else None)
        print(f"      {score.outcome.upper()} in {score.seconds:.0f} s: {score.why}", file=sys.stderr, flush=True)
        scores.append(score)
    if args.json:
        print(json.dumps({"scores": [asdict(s) for s in scores], "totals": totals(scores)}, indent=1))
    elif args.markdown:
        print(render_markdown(scores))
    else:
        print(render(scores))
    return 0


if __name__ == "__main__":
    sys.exit(main())
