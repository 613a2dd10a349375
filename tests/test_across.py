"""`samebits verify --across` (issue 28 items 4-5): layouts in the one cell grammar or as a
product of sizes, every layout compared with the first by global digest at every step, the
negative controls in the same run (a control that does not differ fails the verdict), the
certificate and its page; and `diff --by global` of a resumed run against the full one.

The fast tests drive the runner with a fake program (tests/scripts_across/fake_layout.py: a
"layout" records one global parameter whose values it is told); the slow ones run the recipe.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import samebits
from samebits import checkpoint
from samebits.cli import main
from samebits.cli._recipe import across_layouts, across_reductions
from samebits.errors import ConfigError
from samebits.recipes import cells
from samebits.recipes import commands as recipe
from samebits.recipes.cells import ParallelDims, parse_layouts
from samebits.runners.across import CERTIFICATE, AcrossResult, Layout, verify_across
from samebits.runners.program import SelfRecording
from samebits.runners.conclusion import across_conclusion, diff_conclusion
from samebits.runners.report import build_report
from samebits.verdicts import Verdict

FAKE = Path(__file__).parent / "scripts_across" / "fake_layout.py"


# -- the layouts: cells, the product form, the switches each needs ------------------------------

def test_layouts_as_cells_or_as_a_product_of_sizes():
    assert [d.name for d in parse_layouts("single,dp2,tp2,fsdp2")] == ["single", "dp2", "tp2", "fsdp2"]
    assert [d.name for d in parse_layouts("dp=1,2,4")] == ["single", "dp2", "dp4"]
    assert [d.name for d in parse_layouts("dp=1,2 tp=1,2")] == ["single", "tp2", "dp2", "tp2-dp2"]
    assert [d.name for d in parse_layouts("dp=1,2  ep=1,2")] == ["single", "ep2", "dp2"]  # ep=N implies dp=N
    assert parse_layouts("tp2-dp2,single")[0] == ParallelDims(dp_replicate=2, tp=2)


@pytest.mark.parametrize("spec, message", [
    ("dp=1", "at least two layouts"),
    ("single", "at least two layouts"),
    ("dp2,dp2", "dp2 is given twice"),
    ("tp=1,2 tp=4", "tp is given twice"),
    ("xp=1,2", "'xp=1,2' is not KEY=N,N"),
    ("dp=1,0", "positive sizes"),
    ("single,tp2x", "'tp2x' is not one of dpN"),
    ("", "no layouts"),
])
def test_a_bad_layout_spec_says_what_and_how(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_layouts(spec)


def test_each_cell_asks_the_recipe_for_its_switches_and_the_run_takes_them_all():
    assert recipe.invariant_overrides(ParallelDims()) == []
    assert recipe.invariant_overrides(ParallelDims.parse("dp2")) == ["grad_reduce=invariant"]
    assert recipe.invariant_overrides(ParallelDims.parse("tp2")) == ["tp_reduce=invariant"]
    assert recipe.invariant_overrides(ParallelDims.parse("fsdp2-tp2")) == ["grad_reduce=invariant",
                                                                             "tp_reduce=invariant"]
    assert recipe.invariant_overrides(ParallelDims.parse("ep2")) == ["grad_reduce=invariant"]
    assert recipe.across_switches(parse_layouts("single,pp2,ep2")) == ["grad_reduce=invariant"]
    assert recipe.invariant_overrides(ParallelDims.parse("pp2")) == ["grad_reduce=invariant"]
    cells = parse_layouts("single,dp2,tp2")
    assert recipe.across_switches(cells) == ["grad_reduce=invariant", "tp_reduce=invariant"]
    # the certificate lists what the layouts split, not every size a switch would cover
    assert [(r["switch"], r["size"]) for r in across_reductions("single,dp2,tp2")] == [
        ("grad_reduce=invariant", "dp_replicate"), ("tp_reduce=invariant", "tp")]
    assert [r["size"] for r in across_reductions("single,tp2")] == ["tp"]
    assert [r["size"] for r in across_reductions("single,fsdp2,pp2,ep2")] == ["dp_replicate", "dp_shard", "pp", "ep"]
    assert len(recipe.invariant_reductions(["grad_reduce=invariant"])) == 4  # without cells: every size it covers


def test_the_layouts_programs_and_their_controls():
    """Every layout runs with every switch (one function), experts replicated; its control is
    the same cell with the switches off, on the matrix's global batch, for two steps."""
    single, dp2, tp2 = across_layouts("single,dp2,tp2", steps=6, overrides=["seed=3"])
    assert (single.nproc, dp2.nproc, tp2.nproc) == (1, 2, 2)
    for layout in (single, dp2, tp2):
        record = " ".join(layout.program.record)
        assert "--set grad_reduce=invariant --set tp_reduce=invariant --set seed=3" in record, record
        assert "--set ep=1" in record and layout.program.steps == 6
        control = " ".join(layout.control.record)
        assert "--set grad_reduce=mean --set tp_reduce=plain --set seed=3" in control, control
        assert "--set dropout=0" in control and layout.control.steps == 2
    assert "--set micro_batch_size=8" in " ".join(single.control.record)
    assert "--set micro_batch_size=4" in " ".join(dp2.control.record)  # the same global batch of 8
    assert "--set tp=2" in " ".join(tp2.program.record) and "--set dp_replicate=2" in " ".join(dp2.program.record)
    own_batch = across_layouts("single,dp2", steps=2, overrides=["micro_batch_size=2"])[1].control.record
    assert "micro_batch_size=4" not in " ".join(own_batch) and own_batch.count("micro_batch_size=2") == 1
    assert across_layouts("single,dp2", steps=2, controls=False)[1].control is None


def test_the_command_line_refuses_a_layout_that_is_not_invariant_before_any_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    # every axis has a switch today: an axis given a refusal instead is refused by name
    ep = next(axis for axis in cells.AXES if axis.word == "ep")
    refused = dataclasses.replace(ep, switch=None, refusal="expert parallelism is not layout-invariant yet")
    with monkeypatch.context() as patch:
        patch.setattr(cells, "AXES", tuple(refused if axis is ep else axis for axis in cells.AXES))
        with pytest.raises(ConfigError, match=r"^ep2: expert parallelism is not layout-invariant yet \(.*docs/invari"):
            recipe.invariant_overrides(ParallelDims.parse("ep2"))
        assert main(["verify", "--across", "single,ep2", "--out", str(out)]) == 2
        assert "ep2: expert parallelism is not layout-invariant yet" in capsys.readouterr().err
    assert not out.exists()
    # a command takes cells too (it reads SAMEBITS_LAYOUT), but not a word that is no cell
    assert main(["verify", "--across", "single,dp2x", "--out", str(out), "--", "python", "t.py", "{nproc}",
                 "{out}"]) == 2
    assert "layout 'dp2x' is neither dp=N,N,... (data-parallel sizes) nor a cell" in capsys.readouterr().err
    assert not out.exists()
    assert main(["verify", "--across", "single,dp2048", "--out", str(out)]) == 2
    assert "dp2048 needs 2048 ranks" in capsys.readouterr().err


def test_an_axis_with_neither_a_switch_nor_a_refusal_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    """The closed world of `cells.AXES`: an axis added to the grammar (here context parallel,
    "cpN", with its size in `ParallelDims`) but given no layout-invariant switch and no refusal
    is refused by `verify --across`, naming the axis and the table."""
    assert all((axis.switch is None) != (axis.refusal is None) for axis in cells.AXES)  # each has one, not both
    cp = cells.Axis("cp", "cp", mesh=4, name_order=5, coordinate="cp")
    dims = dataclasses.make_dataclass("ParallelDims", [("cp", int, 1)], bases=(ParallelDims,), frozen=True)
    monkeypatch.setattr(cells, "AXES", (*cells.AXES, cp))
    monkeypatch.setattr(cells, "ParallelDims", dims)
    assert cells.ParallelDims.parse("cp2-tp2").name == "tp2-cp2" and cells.ParallelDims.parse("cp2").world_size == 2
    out = tmp_path / "out"
    assert main(["verify", "--across", "single,cp2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cp2: the axis cp has neither a layout-invariant switch nor a refusal in samebits.recipes.cells.AXES" in err
    assert not out.exists()


# -- the runner with a fake program: the comparison, the controls, the certificate ---------------

def _program(name: str, values: str, steps: int = 4, *, resume: tuple[str, ...] = (),
             extra: tuple[str, ...] = ()) -> SelfRecording:
    """The fake program: trains one global parameter, recorded per step, ``values`` (a seed)
    fixing its draws; ``resume``: words its resume adds (``--perturb-resume``, ...)."""
    base = [sys.executable, str(FAKE), "--out", "{out}", "--steps", str(steps), "--values", values, "--name", name,
            *extra]
    return SelfRecording(steps=steps, nproc=1, record=tuple(base),
                         save=tuple(base + ["--save-at", "{step}", "--ckpt", "{ckpt}"]),
                         save_only=tuple(base + ["--save-at", "{step}", "--ckpt", "{ckpt}"]),
                         resume=tuple(base + ["--resume-from", "{ckpt}", "--save-at", str(steps), "--ckpt",
                                              "{out}/ckpt", *resume]))


def _layouts(*, control_values=("plain-single", "plain-dp2"), second="same", controls=True) -> list[Layout]:
    return [Layout("single", 1, _program("single", "same"),
                   _program("control-single", control_values[0], 2) if controls else None,
                   ("grad_reduce=invariant",), ("grad_reduce=mean",)),
            Layout("dp2", 2, _program("dp2", second),
                   _program("control-dp2", control_values[1], 2) if controls else None,
                   ("dp_replicate=2", "grad_reduce=invariant"), ("dp_replicate=2", "grad_reduce=mean"))]


REDUCTIONS = [{"switch": "grad_reduce=invariant", "size": "dp_replicate", "covers": "the DP reduction"}]


@pytest.fixture(scope="module")
def passed(tmp_path_factory):
    """Equal layouts, controls that differ: (out, result); shared by the tests that read it."""
    out = tmp_path_factory.mktemp("across") / "pass"
    return out, verify_across(_layouts(), out=out, reductions=REDUCTIONS, resume_across=True)


@pytest.fixture(scope="module")
def diverged(tmp_path_factory):
    """dp2 differs from step 2 on: (out, result)."""
    out = tmp_path_factory.mktemp("across") / "diverged"
    return out, verify_across(_layouts(second="from-step-2"), out=out)


def test_equal_layouts_with_differing_controls_pass_and_write_the_certificate(passed):
    out, result = passed
    assert result.verdict is Verdict.PASS, result.to_dict()
    check = result.checks["dp2"]
    assert check.by == "global" and check.compared["steps"] == 4 and check.metrics["verdict"] == "identical"
    assert [(c.run, c.differs, c.first_step) for c in result.controls] == [("control-dp2", True, 0)]
    cert = json.loads((out / CERTIFICATE).read_text())
    assert cert["verdict"] == "pass" and cert["reference"] == "single"
    assert set(cert["environment"]) >= {"samebits", "torch", "python", "cpu", "device", "platform"}
    assert cert["environment"]["torch"] == torch.__version__.split("+")[0] or \
        cert["environment"]["torch"] == torch.__version__
    assert [(l["cell"], l["world_size"], l["overrides"]) for l in cert["layouts"]] == [
        ("single", 1, ["grad_reduce=invariant"]), ("dp2", 2, ["dp_replicate=2", "grad_reduce=invariant"])]
    assert all(str(FAKE) in l["command"] for l in cert["layouts"])
    assert cert["steps"] == [0, 1, 2, 3] and cert["roots_equal"] is True
    roots = cert["roots"]
    assert roots["single"] == roots["dp2"] and len(set(roots["single"].values())) == 4  # one root per step
    final = cert["checkpoints"]
    assert final["single"]["step"] == 4 and final["single"]["path"].endswith("single/ckpt/step-4")
    assert final["single"]["content_sha256"] == final["dp2"]["content_sha256"] and cert["checkpoints_equal"] is True
    assert final["resume-dp2"]["content_sha256"] == final["single"]["content_sha256"]  # the resume's final state too
    assert final["single"]["content_sha256"] == checkpoint.content_sha256(out / "single" / "ckpt")["sha256"]
    assert "random states are left out" in cert["checkpoints_note"]
    assert (out / "dp2" / "ckpt" / "step-2").is_dir()  # for replay (and the resume)
    resumed = cert["resume_across"]
    assert resumed["step"] == 2 and resumed["from"] == "single"
    assert resumed["checks"]["dp2"]["verdict"] == "identical" and resumed["checks"]["dp2"]["steps"] == 2
    assert "--resume-from" in resumed["checks"]["dp2"]["command"] and "single/ckpt/step-2" in \
        resumed["checks"]["dp2"]["command"]
    assert cert["invariant_reductions"] == REDUCTIONS
    assert [(c["run"], c["differs"], c["first_step"], c["overrides"]) for c in cert["controls"]] == [
        ("control-dp2", True, 0, ["dp_replicate=2", "grad_reduce=mean"])]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["layouts"] == ["single", "dp2"] and summary["checks"]["dp2"]["verdict"] == "identical"
    assert summary["resume_across"]["checks"]["dp2"]["compared"]["steps"] == 2
    assert "dp2 resumed single's checkpoint of step 2 and matched it bit for bit to step 3" in \
        across_conclusion(AcrossResult.from_dict(summary))


def test_resumes_that_are_not_exact_or_are_refused_are_caught(tmp_path):
    """single saves at step 2; dp2 resumes it with one bit of w flipped: DIVERGED at step 2,
    FAIL; dp4 refuses the resume as the recipe does without its switch: INCOMPLETE, naming
    the switch, never a traceback.  The layouts' own uninterrupted runs still agree."""
    layouts = [Layout("single", 1, _program("single", "same")),
               Layout("dp2", 2, _program("dp2", "same", resume=("--perturb-resume",))),
               Layout("dp4", 4, _program("dp4", "same", resume=("--refuse-resume",)))]
    result = verify_across(layouts, out=tmp_path / "bad", controls=False, resume_across=True, resume_at=2)
    assert [Verdict(c.verdict) for c in result.checks.values()] == [Verdict.IDENTICAL, Verdict.IDENTICAL]
    perturbed, refused = result.resume["dp2"], result.resume["dp4"]
    assert Verdict(perturbed.verdict) is Verdict.DIVERGED and perturbed.first_divergence["step"] == 2
    assert perturbed.first_divergence["name"] in ("w", "loss")
    assert Verdict(refused.verdict) is Verdict.INCOMPLETE
    assert refused.incomplete[0].startswith("dp4 could not resume single's checkpoint of step 2: samebits.recipes: "
                                            "error (rank 0): ")
    assert "--set grad_reduce=invariant" in refused.incomplete[0] and "Traceback" not in refused.incomplete[0]
    assert result.verdict is Verdict.FAIL
    assert result.checkpoints["resume-dp2"]["content_sha256"] != result.checkpoints["single"]["content_sha256"]
    assert "resume-dp4" not in result.checkpoints and result.checkpoints_equal is False
    summary = json.loads((tmp_path / "bad" / "summary.json").read_text())
    sentence = across_conclusion(AcrossResult.from_dict(summary))
    assert "dp2 resumed from single's checkpoint of step 2 diverged at step 2" in sentence, sentence
    assert "dp4 could not resume" in sentence and "grad_reduce=invariant" in sentence
    cert = json.loads((tmp_path / "bad" / CERTIFICATE).read_text())
    assert cert["resume_across"]["checks"]["dp4"]["verdict"] == "incomplete"


def test_final_checkpoints_that_differ_fail_even_when_every_root_is_equal(tmp_path):
    """dp2 records the same parameters but saves another data position: the roots are equal,
    the final checkpoints' content hashes are not, and the verdict says so (FAIL)."""
    layouts = [Layout("single", 1, _program("single", "same")),
               Layout("dp2", 2, _program("dp2", "same", extra=("--samples-per-step", "9")))]
    result = verify_across(layouts, out=tmp_path / "ckpt", controls=False)
    assert Verdict(result.checks["dp2"].verdict) is Verdict.IDENTICAL
    assert result.checkpoints_equal is False and result.verdict is Verdict.FAIL
    cert = json.loads((tmp_path / "ckpt" / CERTIFICATE).read_text())
    assert cert["roots_equal"] is True and cert["checkpoints_equal"] is False and cert["verdict"] == "fail"
    sentence = across_conclusion(AcrossResult.from_dict(json.loads((tmp_path / "ckpt" / "summary.json").read_text())))
    assert sentence.startswith("FAIL: ") and "the final checkpoints' content hashes differ: dp2 against single" in \
        sentence, sentence


def test_resume_across_options_are_checked_before_any_run(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"--resume-at 4: the resume step must lie inside the run, between 1 and 3"):
        verify_across(_layouts(controls=False), out=tmp_path / "a", resume_across=True, resume_at=4)
    with pytest.raises(ConfigError, match="--resume-at with --across needs --resume-across"):
        verify_across(_layouts(controls=False), out=tmp_path / "a", resume_at=2)
    assert not (tmp_path / "a").exists()
    assert main(["verify", "--across", "dp=1,2", "--resume-across", "--out", str(tmp_path / "b"), "--", "python",
                 "t.py", "{nproc}", "{out}"]) == 2
    assert "--resume-across with a command: give --resume-with 'CMD'" in capsys.readouterr().err
    assert main(["verify", "--resume-across", "--out", str(tmp_path / "c")]) == 2
    assert "--resume-across needs --across" in capsys.readouterr().err
    single, dp2 = across_layouts("single,dp2", steps=4, controls=False)
    resume = " ".join(dp2.resume)
    assert "--resume-from {ckpt} --allow-layout-change" in resume and "--set dp_replicate=2" in resume
    assert "--save-at 4 --ckpt {out}/ckpt --keep-going" in resume
    assert "--nproc-per-node 2" in resume and "--out {out}" in resume


def test_a_control_that_does_not_differ_fails_the_verdict(tmp_path):
    """The same layouts without the switch computing the same bits: the comparison could not
    tell layouts apart, so the equality of the layouts proves nothing."""
    result = verify_across(_layouts(control_values=("plain", "plain")), out=tmp_path / "blind")
    assert Verdict(result.checks["dp2"].verdict) is Verdict.IDENTICAL
    assert result.verdict is Verdict.FAIL and [c.differs for c in result.controls] == [False]
    summary = json.loads((tmp_path / "blind" / "summary.json").read_text())
    sentence = across_conclusion(AcrossResult.from_dict(summary))
    assert sentence.startswith("FAIL: ") and "the control did not differ for dp2" in sentence
    assert "the comparison cannot tell layouts apart" in sentence


def test_a_layout_that_differs_fails_at_its_first_step_and_roots_show_it(diverged):
    out, result = diverged
    check = result.checks["dp2"]
    assert result.verdict is Verdict.FAIL and Verdict(check.verdict) is Verdict.DIVERGED
    assert check.first_divergence["step"] == 2 and check.first_divergence["name"] == "w"
    cert = json.loads((out / CERTIFICATE).read_text())
    assert cert["roots_equal"] is False
    assert [cert["roots"]["single"][s] == cert["roots"]["dp2"][s] for s in "0123"] == [True, True, False, False]


def test_no_controls_is_said_in_the_certificate_and_the_verdict_stands_on_the_comparison(tmp_path):
    result = verify_across(_layouts(control_values=("plain", "plain")), out=tmp_path / "n", controls=False)
    assert result.verdict is Verdict.PASS and result.controls is None
    cert = json.loads((tmp_path / "n" / CERTIFICATE).read_text())
    assert cert["controls"] is None and cert["controls_note"] == "not run: --no-controls"
    assert not (tmp_path / "n" / "control-dp2").exists()


def test_the_report_page_leads_with_the_conclusion_and_renders_the_certificate(passed, diverged, tmp_path):
    out = passed[0]
    report = build_report([out])
    assert report.kind == "verify --across" and report.verdict is Verdict.PASS
    assert report.conclusion.startswith("PASS: dp2 (4 steps) bit-identical to single by global digest")
    assert "every control (without the switches) differed at step 0" in report.conclusion
    assert {"Verdicts", "Negative controls", "Certificate"} <= set(report.sections)
    assert "every layout (single, dp2) holds the same global root at every step" in report.html
    assert "grad_reduce=invariant" in report.html and "control-dp2" in report.html
    cert = json.loads((out / CERTIFICATE).read_text())
    assert cert["checkpoints"]["dp2"]["content_sha256"] in report.html
    assert "Resume across layouts" in report.sections and "resume-dp2" in report.html
    page = build_report([diverged[0]])
    assert "holds the same global root" not in page.html and page.verdict is Verdict.FAIL
    assert "dp2 diverged from single at step 2 (params/w)" in page.conclusion
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "summary.json").write_text((diverged[0] / "summary.json").read_text())
    (damaged / CERTIFICATE).write_text("{not json")
    with pytest.raises(ConfigError, match="certificate.json: cannot be read as JSON"):
        build_report([damaged])


# -- diff --by global of a resumed run ---------------------------------------------------------

def _steps(directory, steps, world_size=1):
    for rank in range(world_size):
        with samebits.Recorder(directory, rank=rank, world_size=world_size, config={"w": 1}) as rec:
            for step in steps:
                rec.global_tensors(step, "params", [("w", torch.full((4,), float(step)))])


def test_diff_by_global_compares_a_resumed_run_from_its_first_step(tmp_path):
    """The full run holds steps 0-3, the run resumed at step 2 steps 2-3 (identical): not
    DIVERGED at step 0, but INCOMPLETE saying where it starts; a window from step 2 is
    IDENTICAL; a difference after the resume is DIVERGED there."""
    _steps(tmp_path / "full", range(4))
    _steps(tmp_path / "resumed", range(2, 4), world_size=2)
    result = samebits.diff(tmp_path / "full", tmp_path / "resumed", by="global")
    assert result.verdict is Verdict.INCOMPLETE, result.to_dict()
    assert "--from-step 2" in result.incomplete[0] and any("b starts at step 2" in n for n in result.notes)
    assert samebits.diff(tmp_path / "resumed", tmp_path / "full", by="global").verdict is Verdict.INCOMPLETE
    window = samebits.diff(tmp_path / "full", tmp_path / "resumed", by="global", start_step=2)
    assert window.verdict is Verdict.IDENTICAL and window.compared["steps"] == 2
    with samebits.Recorder(tmp_path / "bad", rank=0, world_size=1, config={"w": 1}) as rec:
        rec.global_tensors(2, "params", [("w", torch.full((4,), 2.0))])
        rec.global_tensors(3, "params", [("w", torch.full((4,), 9.0))])
    bad = samebits.diff(tmp_path / "full", tmp_path / "bad", by="global")
    assert bad.verdict is Verdict.DIVERGED and bad.first_step == 3
    # the window it chose is in the result (as a rank-by-rank diff's), so the sentence names it
    assert bad.to_dict()["resumed"] == {"run": "b", "step": 2} and "resumed" not in window.to_dict()
    assert diff_conclusion(bad.to_dict()).endswith("(compared from step 2, where b starts: b resumed a run)")


# -- the recipe, end to end ---------------------------------------------------------------------

@pytest.mark.slow
def test_the_recipe_across_single_dp2_and_tp2_passes_with_its_controls_and_a_certificate(tmp_path, capsys):
    """`samebits verify --across single,dp2,tp2 --steps 3`: every layout with grad_reduce=invariant
    and tp_reduce=invariant, every step's parameters equal by global digest; the controls
    (grad_reduce=mean, tp_reduce=plain) differ at step 0."""
    out = tmp_path / "across"
    code = main(["verify", "--across", "single,dp2,tp2", "--steps", "3", "--out", str(out), "--json",
                 "--set", "num_layers=2", "--set", "seq_len=32"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["verdict"] == "pass", shown
    for name in ("dp2", "tp2"):
        assert shown["checks"][name]["by"] == "global" and shown["checks"][name]["compared"]["steps"] == 3
    assert [(c["run"], c["differs"], c["first_step"]) for c in shown["controls"]] == [("control-dp2", True, 0),
                                                                                      ("control-tp2", True, 0)]
    cert = json.loads((out / CERTIFICATE).read_text())
    assert cert["roots_equal"] and cert["steps"] == [0, 1, 2]
    assert [(r["switch"], r["size"]) for r in cert["invariant_reductions"]] == [
        ("grad_reduce=invariant", "dp_replicate"), ("tp_reduce=invariant", "tp")]  # the sizes these layouts split
    assert set(cert["checkpoints"]) == {"single", "dp2", "tp2"}
    # the final step's checkpoints hold one training state: by content, not by files
    assert cert["checkpoints_equal"] is True, cert["checkpoints"]
    assert len({c["content_sha256"] for c in cert["checkpoints"].values()}) == 1
    assert len({c["files_sha256"] for c in cert["checkpoints"].values()}) == 3
    assert all(c["step"] == 3 for c in cert["checkpoints"].values())


@pytest.mark.slow
def test_the_recipe_resumes_a_tp2_dp2_checkpoint_at_one_rank_and_at_dp4_bit_for_bit(tmp_path, capsys):
    """`samebits verify --across tp2-dp2,single,dp4 --resume-across --steps 4 --resume-at 2`:
    tp2-dp2 saves at step 2; single and dp4 resume it (--allow-layout-change) and equal its
    uninterrupted run by global digest and metrics at steps 2 and 3; every final checkpoint
    holds the same training state."""
    out = tmp_path / "resume"
    code = main(["verify", "--across", "tp2-dp2,single,dp4", "--resume-across", "--steps", "4", "--resume-at", "2",
                 "--no-controls", "--out", str(out), "--json", "--set", "num_layers=2", "--set", "seq_len=32"])
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and shown["verdict"] == "pass", shown
    resumed = shown["resume_across"]
    assert resumed["step"] == 2 and resumed["from"] == "tp2-dp2"
    for name in ("single", "dp4"):
        check = resumed["checks"][name]
        assert check["verdict"] == "identical" and check["by"] == "global", check
        assert check["compared"]["steps"] == 2 and check["metrics"]["verdict"] == "identical"
    commands = {run["name"]: run["command"] for run in shown["runs"]}
    assert "--allow-layout-change" in commands["resume-dp4"] and "tp2-dp2/ckpt/step-2" in commands["resume-dp4"]
    assert shown["checkpoints_equal"] is True and set(shown["checkpoints"]) == {
        "tp2-dp2", "single", "dp4", "resume-single", "resume-dp4"}


@pytest.mark.slow
def test_the_recipe_refuses_a_resume_at_another_dp_size_without_its_switch(tmp_path, capsys):
    """With grad_reduce=mean set by hand, dp2 cannot resume single's checkpoint: the recipe
    refuses, and the resume check is INCOMPLETE naming the switch (not a traceback)."""
    out = tmp_path / "refused"
    code = main(["verify", "--across", "single,dp2", "--resume-across", "--steps", "2", "--no-controls",
                 "--out", str(out), "--json", "--set", "num_layers=2", "--set", "seq_len=32",
                 "--set", "grad_reduce=mean"])
    shown = json.loads(capsys.readouterr().out)
    check = shown["resume_across"]["checks"]["dp2"]
    assert check["verdict"] == "incomplete", check
    assert check["incomplete"][0].startswith("dp2 could not resume single's checkpoint of step 1: samebits.recipes: "
                                             "error"), check
    assert "grad_reduce=invariant" in check["incomplete"][0] and "Traceback" not in check["incomplete"][0]
    assert code != 0 and shown["verdict"] != "pass"
