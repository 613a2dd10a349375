"""When and what the state census reads, as real trainers need it (issue 33): a private
generator made, drawn from and dropped between two steps' first forwards (torchtitan's
clock-seeded ``reloop``) is held to the step's census and named by its site; the census is taken
at a step's training forward, not an evaluation before the loop sets the LR (litgpt); a batch
given by keyword is an input and NumPy generators are tracked (HF); a stateful loader's state
digest leaves its generator to the generator's record.  The end-to-end tests run two or three
recorded programs each (about 20 s idle): slow."""

import subprocess
import sys
from pathlib import Path

import pytest

from samebits import diff
from samebits.runners._explain import census_suspects, explain_independent

SCRIPT = Path(__file__).parent / "scripts_census_timing" / "reshuffle.py"
RESHUFFLE_LINE = 17  # the line that makes the clock-seeded generator


def _record(out: Path, reference: Path | None = None) -> Path:
    argv = [sys.executable, "-m", "samebits", "run", "--out", str(out)]
    if reference is not None:
        argv += ["--reference", str(reference)]
    proc = subprocess.run(argv + ["--", sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_generator_made_and_dropped_in_the_data_fetch_is_named(tmp_path):
    assert f"PLANTED" in SCRIPT.read_text().splitlines()[RESHUFFLE_LINE - 1]
    a = _record(tmp_path / "a")
    b = _record(tmp_path / "b", reference=a)
    result = diff(a, b)
    step = result.first_divergence.step
    assert step == 2  # the second epoch's first batch
    findings = explain_independent(a, b, step)
    assert findings and findings[0].kind == "generator", [f.says for f in findings]
    assert findings[0].generator == f"user:reshuffle.py:{RESHUFFLE_LINE}"
    assert "made after step 1 ended and before step 2's first forward" in findings[0].says, findings[0].says
    # bisect reads the same census: the private generator is its suspect
    suspects, _ = census_suspects([], a, b, 0, step)
    assert suspects == [f"rng.user.reshuffle.py:{RESHUFFLE_LINE}"], suspects


EVAL_FIRST = Path(__file__).parent / "scripts_census_timing" / "eval_first.py"


@pytest.mark.slow
def test_the_census_is_taken_at_the_training_forward_not_an_evaluation_before_it(tmp_path):
    """A loop that evaluates (no grad) before it sets the step's LR and trains (litgpt's): the
    census of a step was taken at the evaluation, before the LR was set, so a resume that forgot
    its iteration counter showed the same LR as A and was blamed on something else."""
    from samebits.runners._explain import explain_resume

    ckpt = tmp_path / "ckpt.pt"
    a = tmp_path / "a"
    proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(a), "--", sys.executable,
                           str(EVAL_FIRST), "--save-at", "4", "--ckpt", str(ckpt)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = tmp_path / "c"
    proc = subprocess.run([sys.executable, "-m", "samebits", "run", "--out", str(c), "--step-offset", "4", "--",
                           sys.executable, str(EVAL_FIRST), "--resume-from", str(ckpt)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    findings = explain_resume(a, None, c, 4, 4)
    assert findings and findings[0].kind == "iteration_counter", [f.says for f in findings]


@pytest.mark.slow
def test_a_batch_given_by_keyword_is_a_recorded_input(tmp_path):
    """HF's ``model(**inputs)``: a global forward pre-hook sees no keyword arguments, so the
    batch was no recorded input, and two runs fed different batches got no finding at all."""
    script = Path(__file__).parent / "scripts_census_timing" / "keyword_batch.py"
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        argv = [sys.executable, "-m", "samebits", "run", "--out", str(out), "--", sys.executable, str(script)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(out)
    result = diff(*runs)
    assert result.first_divergence.step == 0
    kinds = {(f.kind, f.generator) for f in explain_independent(*runs, 0)}
    assert ("generator", "user:keyword_batch.py:8") in kinds, kinds


def test_a_loader_s_state_digest_leaves_its_generator_to_the_generator_s_record():
    """torchdata's state_dict holds its sampler's generator state: a loader at the right
    position whose generator is not (litgpt's next epoch after a torchdata restore) was named a
    data position; the generator has its own census record, which names it."""
    import torch

    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from samebits.autorecord._tracking import _state_digest

    def loader_state(seed: int, batches: int) -> bytes:
        loader = stateful.StatefulDataLoader(list(range(12)), batch_size=2, shuffle=True,
                                             generator=torch.Generator().manual_seed(seed))
        iterator = iter(loader)
        for _ in range(batches):
            next(iterator)
        return _state_digest(loader.state_dict())

    assert loader_state(0, 2) == loader_state(1, 2)  # same position, other generator
    assert loader_state(0, 2) != loader_state(0, 3)  # another position
