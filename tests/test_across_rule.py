"""One comparison rule for `verify --across` (issue 34 item 1), as for `diff`: a record counts
as compared only with both digests present and equal; every record of the first layout must
be found at every other layout (by name, or by a declared mapping such as DDP's ``module.``
prefix, named in the verdict), else INCOMPLETE naming what is missing; the certificate carries
the counts.  The runs come from tests/scripts_across/fake_replicas.py (rank-local records only,
as a command without global records has), run in this process for the comparator's tests and
through ``verify --across dp=1,2 -- python ...`` once for the certificate.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from samebits.runners.across import CERTIFICATE, command_layouts, compare_layouts, compare_replicated, verify_across
from samebits.verdicts import Verdict

SCRIPT = Path(__file__).parent / "scripts_across" / "fake_replicas.py"
_spec = importlib.util.spec_from_file_location("fake_replicas", SCRIPT)
fake_replicas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_replicas)


def _runs(tmp_path, *extra) -> tuple[Path, Path]:
    for nproc in (1, 2):
        fake_replicas.main(["--nproc", str(nproc), "--out", str(tmp_path / f"dp{nproc}"), *extra])
    return tmp_path / "dp1", tmp_path / "dp2"


def test_equal_replicas_are_identical_and_every_record_counts(tmp_path):
    check = compare_layouts(*_runs(tmp_path), "dp2")
    assert check.verdict is Verdict.IDENTICAL, check.to_dict()
    assert check.counts == {"compared": 9, "shape_only": 0, "missing": 0}  # w, big, loss at 3 steps


def test_tensors_over_the_size_cap_are_never_equal_even_when_their_values_differ(tmp_path):
    """``big`` differs at dp2 from step 1, recorded over max_tensor_bytes on both sides: no
    digest, so it was compared by shape only.  The old comparator called it equal: PASS."""
    a, b = _runs(tmp_path, "--vary", "big", "--max-tensor-bytes", "1000")
    check = compare_replicated(a, b)
    assert check.verdict is Verdict.INCOMPLETE, check.to_dict()
    assert check.compared["shape_only"] == 3 and check.compared["records"] == 6
    assert "params/big (from step 0)" in check.incomplete[0] and "max_tensor_bytes" in check.incomplete[0]
    assert compare_layouts(a, b, "dp2").counts == {"compared": 6, "shape_only": 3, "missing": 0}


def test_ddp_names_are_matched_by_the_declared_mapping_and_said(tmp_path):
    """dp2 names the parameter ``module.w``: it is compared with dp1's ``w`` (the old comparator
    listed it as held by one layout and compared the loss only: a differing w PASSed)."""
    same = compare_replicated(*_runs(tmp_path / "same", "--ddp-names"))
    assert same.verdict is Verdict.IDENTICAL and same.compared["records"] == 9, same.to_dict()
    assert any(note.startswith("matched by DDP's `module.` prefix: 1 record name(s)") and "w -> module.w" in note
               for note in same.notes), same.notes
    varied = compare_replicated(*_runs(tmp_path / "varied", "--ddp-names", "--vary", "w"))
    assert varied.verdict is Verdict.DIVERGED, varied.to_dict()
    assert (varied.first_divergence.step, varied.first_divergence.name) == (1, "w")


def test_a_parameter_the_other_layout_did_not_record_is_incomplete_naming_it(tmp_path):
    check = compare_replicated(*_runs(tmp_path, "--drop", "w"))
    assert check.verdict is Verdict.INCOMPLETE, check.to_dict()
    assert check.compared["missing"] == 3
    assert "1 record(s) only in" in check.incomplete[0] and "params/w (from step 0)" in check.incomplete[0]


@pytest.mark.parametrize("attack, verdict", [
    pytest.param(("--drop", "w"), "incomplete", marks=pytest.mark.slow),
    (("--ddp-names", "--vary", "w"), "fail"),
    pytest.param(("--vary", "big", "--max-tensor-bytes", "1000"), "incomplete", marks=pytest.mark.slow)])
def test_verify_across_a_command_never_passes_the_issue_attacks_and_the_certificate_counts(tmp_path, attack,
                                                                                            verdict):
    cmd = [sys.executable, str(SCRIPT), "--nproc", "{nproc}", "--out", "{out}", *attack]
    result = verify_across(command_layouts([1, 2], cmd), tmp_path / "out")
    assert result.verdict.value == verdict, result.to_dict()
    cert = json.loads((tmp_path / "out" / CERTIFICATE).read_text())
    assert cert["verdict"] == verdict
    counts = cert["checks"]["dp2"]["counts"]
    assert set(counts) == {"compared", "shape_only", "missing"}
    if "--drop" in attack:
        assert counts["missing"] == 3 and any("params/w" in line for line in cert["checks"]["dp2"]["incomplete"])
    if "--max-tensor-bytes" in attack:
        assert counts["shape_only"] == 3



def test_one_rule_for_every_comparator_a_record_without_digest_is_shape_only():
    """`record_match` is the rule of `diff`, `diff --by global` and `verify --across`.  The
    Recorder digests every global tensor, so a capped global record comes only from a crafted
    stream: `diff_global`'s fold is checked on such records directly (the old one called them
    equal: None == None)."""
    from samebits.compare import SHAPE_ONLY, record_match  # noqa: PLC0415
    from samebits.compare._global import _compare  # noqa: PLC0415
    from samebits.stream import _format as fmt  # noqa: PLC0415
    from samebits.stream.reader import Record  # noqa: PLC0415

    def tensor(digest, flags=0, shape=(64,)):
        return Record("tensor", "global:params", "big", 0, "float32", shape, flags, digest, None)

    capped = tensor(None, fmt.FLAG_CAPPED)
    assert record_match(capped, capped) == SHAPE_ONLY
    assert record_match(capped, tensor(7)) == SHAPE_ONLY  # one side without a digest: never equal
    assert record_match(capped, tensor(None, fmt.FLAG_CAPPED, (65,))) == "differs"
    results = {}
    _compare(results, ("params", "big", 0), 0, capped, capped, [], None)
    assert results[("params", "big", 0)].status == "shape_only"
    _compare(results, ("params", "big", 0), 1, tensor(1), tensor(2), [], None)
    assert results[("params", "big", 0)].status == "differs"  # a later difference still shows


def test_inputs_of_micro_batches_another_layout_does_not_hold_are_noted_not_missing(tmp_path):
    """dp2's rank 0 reads micro-batches 0 and 1, dp4's only 0: ``data/tokens.mb1`` is the
    layout's, never a record the other layout lost (tests/test_resume_layout.py's dp2 -> dp4)."""
    import torch  # noqa: PLC0415
    import samebits  # noqa: PLC0415
    for name, world, batches in (("dp2", 2, 2), ("dp4", 4, 1)):
        with samebits.Recorder(tmp_path / name, rank=0, world_size=world) as rec:
            rec.tensors(0, "params", [("w", torch.ones(3))])
            rec.tensors(0, "data", [(f"tokens.mb{m}", torch.full((4,), m)) for m in range(batches)])
            rec.end_step(0)
    check = compare_replicated(tmp_path / "dp2", tmp_path / "dp4")
    assert check.verdict is Verdict.IDENTICAL, check.to_dict()
    assert check.compared["not_held"] == 1 and check.compared["missing"] == 0
    assert any("data/tokens.mb1" in note and "does not" in note for note in check.notes), check.notes
