"""`samebits report` shows only verdicts it re-derives, and reads certificate.json as strictly as
summary.json (issue 34 items 5 and 8).

The folders are real `verify --across dp=1,2` outputs of tests/scripts_across/fake_replicas.py
(a FAIL: dp2's parameter differs from step 1; a PASS), edited as an attacker would: the verdict
word turned to "pass" (the old page rendered "PASS: dp2 diverged from dp1 at step 1"), a field
of the certificate given the wrong type (15 fields, each a traceback before), a certificate
nested 100,000 deep (RecursionError).  Every one is one line naming the file, exit 2.  The
Hypothesis test (slow set) mutates the certificate at random: 0 false PASS, 0 tracebacks.
"""

import json
import shutil
import sys
from pathlib import Path

import pytest

from samebits.cli import main
from samebits.compare import DiffResult, Divergence
from samebits.errors import ConfigError
from samebits.runners.across import CERTIFICATE, command_layouts, verify_across
from samebits.runners.matrix import CellResult, MatrixResult
from samebits.runners.report import build_report
from samebits.runners.verify import VerifyResult
from samebits.verdicts import Verdict

SCRIPT = Path(__file__).parent / "scripts_across" / "fake_replicas.py"


def _across(out: Path, *extra) -> Path:
    verify_across(command_layouts([1, 2], [sys.executable, str(SCRIPT), "--nproc", "{nproc}", "--out", "{out}", *extra]),
                  out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trust")
    return {"fail": _across(root / "fail", "--vary", "w"), "pass": _across(root / "pass")}


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def _edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_genuine_folders_render_their_own_verdicts(folders):
    assert build_report([folders["fail"]]).verdict is Verdict.FAIL
    assert build_report([folders["pass"]]).verdict is Verdict.PASS


def test_a_fail_edited_to_pass_is_refused_never_rendered_pass(folders, tmp_path, capsys):
    out = _copy(folders["fail"], tmp_path)
    for name in ("summary.json", CERTIFICATE):
        _edit(out / name, lambda data: data.update(verdict="pass"))
    with pytest.raises(ConfigError, match=r"summary.json: it says 'pass' but its checks give 'fail' "
                                          r"\(layout 'dp2': diverged\)"):
        build_report([out])
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert "edited or damaged" in err and "Traceback" not in err and not (tmp_path / "r.html").exists()


def test_a_check_edited_to_identical_is_refused_by_its_own_evidence(folders, tmp_path):
    out = _copy(folders["fail"], tmp_path)

    def whitewash(data):
        data["verdict"] = "pass"
        data["checks"]["dp2"]["verdict"] = "identical"
    for name in ("summary.json", CERTIFICATE):
        _edit(out / name, whitewash)
    with pytest.raises(ConfigError, match="says 'identical' but holds a first divergence"):
        build_report([out])


def test_a_certificate_that_disagrees_with_its_summary_is_refused(folders, tmp_path):
    out = _copy(folders["fail"], tmp_path)
    _edit(out / CERTIFICATE, lambda data: data.update(verdict="pass"))
    with pytest.raises(ConfigError, match="certificate.json: it says 'pass' but its checks give 'fail'"):
        build_report([out])


def test_a_more_cautious_verdict_stands_and_is_said(folders, tmp_path):
    out = _copy(folders["pass"], tmp_path)
    for name in ("summary.json", CERTIFICATE):
        _edit(out / name, lambda data: data.update(verdict="incomplete"))
    report = build_report([out])
    assert report.verdict is Verdict.INCOMPLETE
    assert any("says INCOMPLETE where its checks alone give PASS" in note for note in report.notes)


# the 15 fields of the attack: each given a value of the wrong type
WRONG = [("environment", []), ("layouts", {}), ("layouts", [1]), ("steps", "0,1,2"), ("roots", []),
         ("roots", {"dp1": []}), ("checkpoints", []), ("checkpoints", {"dp1": "x"}), ("resume_across", []),
         ("invariant_reductions", {}), ("invariant_reductions", ["x"]), ("controls", {}), ("controls", [1]),
         ("checks", []), ("checks", {"dp2": "identical"})]


@pytest.mark.parametrize("field, value", WRONG, ids=[f"{f}={json.dumps(v)}" for f, v in WRONG])
def test_a_certificate_field_of_the_wrong_type_is_one_error_naming_it(folders, tmp_path, capsys, field, value):
    out = _copy(folders["pass"], tmp_path)
    _edit(out / CERTIFICATE, lambda data: data.update({field: value}))
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err
    assert f"certificate.json: field '{field}" in err and "Traceback" not in err, err


def test_a_certificate_nested_100000_deep_or_too_large_is_refused(folders, tmp_path, capsys):
    out = _copy(folders["pass"], tmp_path)
    (out / CERTIFICATE).write_text("[" * 100_000 + "]" * 100_000)
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 2
    assert "certificate.json: cannot be read as JSON (nested too deeply)" in capsys.readouterr().err
    deep = {"verdict": "pass"}
    for _ in range(70):  # deep enough to refuse, shallow enough for the parser
        deep = {"x": deep}
    (out / CERTIFICATE).write_text(json.dumps({"verdict": "pass", "environment": deep}))
    with pytest.raises(ConfigError, match="nested more than 64 levels deep"):
        build_report([out])


# -- Hypothesis: random edits of certificate.json --------------------------------------------

def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys and list indices)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, prefix + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, prefix + (index,))


@pytest.mark.slow
def test_random_certificate_edits_never_pass_a_fail_and_never_raise_a_traceback(folders, tmp_path_factory):
    from hypothesis import HealthCheck, given, settings  # noqa: PLC0415
    from hypothesis import strategies as st  # noqa: PLC0415

    leaves = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**70), st.floats(allow_nan=True),
                       st.sampled_from(["pass", "fail", "identical", "diverged", "incomplete", "", "\x1b[2J\n"]),
                       st.text(max_size=8))
    values = st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                          st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                          max_leaves=6)
    originals = {kind: json.loads((folders[kind] / CERTIFICATE).read_text()) for kind in folders}
    paths = {kind: list(_paths(cert)) for kind, cert in originals.items()}

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(kind=st.sampled_from(sorted(folders)), data=st.data())
    def check(kind, data):
        cert = json.loads(json.dumps(originals[kind]))
        for _ in range(data.draw(st.integers(1, 3))):
            path = data.draw(st.sampled_from(paths[kind]))
            value = data.draw(values)
            if not path:
                cert = value
                break
            target = cert
            try:
                for step in path[:-1]:
                    target = target[step]
                target[path[-1]] = value
            except (KeyError, IndexError, TypeError):
                continue  # an earlier edit removed the path
        out = tmp_path_factory.mktemp("fuzz")
        shutil.copy(folders[kind] / "summary.json", out / "summary.json")
        (out / CERTIFICATE).write_text(json.dumps(cert))
        try:
            report = build_report([out])
        except ConfigError:
            return
        if kind == "fail":
            assert report.verdict is not Verdict.PASS, cert
        (out / "page.html").write_text(report.html)

    check()


def test_a_matrix_whose_verdict_contradicts_its_cells_is_refused(tmp_path):
    """The matrix's verdict is re-derived from its cells too (a failing cell edited away is not)."""
    first = Divergence(step=3, rank=0, reason="content", phase="params", name="w")
    checks = {"independent": DiffResult("a", "b", Verdict.DIVERGED, first, [0], {0: first}, {"steps": 4}),
              "resume": DiffResult("a", "c", Verdict.IDENTICAL, None, [], {}, {"steps": 4})}
    out = tmp_path / "m"
    cell = CellResult(cell="dp2", precision="fp32", world_size=2, required=True, out=str(out / "dp2-fp32"),
                      verify=VerifyResult(str(out / "dp2-fp32"), checks, {}, 2))
    written = MatrixResult(out=str(out), baseline="dp2 fp32", cells=[cell]).to_dict()  # as matrix writes it
    row = written["cells"][0]
    assert (written["verdict"], row["repeatable"], row["resume"]) == ("fail", "no", "yes")
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({**written, "verdict": "pass", "failures": []}))
    with pytest.raises(ConfigError, match=r"it says 'pass' but its checks give 'fail'"):
        build_report([out])
    (out / "summary.json").write_text(json.dumps({**written, "verdict": "pass", "failures": [],
                                                  "cells": [{**row, "verdict": "pass"}]}))
    with pytest.raises(ConfigError, match=r"cell 0 \(dp2 fp32\) says 'pass' but a check of it diverged"):
        build_report([out])
