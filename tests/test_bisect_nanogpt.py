"""`samebits bisect` on a nanoGPT-style train.py (tests/scripts_bisect/nanogpt.py: its own
`--init-from resume`, a prefetching `get_batch` on the global generator, an eval pass every
other iteration, `loss.item()` logging after the optimizer step, the iteration counter in the
checkpoint and the LR computed from it), issue 24:

* a resume bisect is aligned on the step's phases: a's leftovers of step K-1 (logging) and
  b's start-up (a prefetch the checkpoint replaces) are no "control flow", and no conclusion
  contradicts an earlier stage's "phase optimizer: inputs matched, output differs";
* the same values in another order (a set-ordered parameter list, param groups from a set)
  are `order`, naming what was reordered, never "all inputs matched".

Each module-scoped fixture is one end-to-end bisect (20-100 s on 2 busy cores); the tests
read its result.  Set-ordered faults get fixed hash seeds per side (PYTHONHASHSEED 0 and 2
order these names differently, and the gradient norm differs at step 1), so they are not
left to chance.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from samebits.runners.bisect import bisect

pytestmark = pytest.mark.slow  # end-to-end bisects of a nanoGPT-shaped trainer (1-3 min in all)

SCRIPT = Path(__file__).resolve().parent / "scripts_bisect" / "nanogpt.py"
K = 2  # the resume step: an eval iteration (eval every 2)


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.read_text().splitlines(), 1) if text in line)


def python(*args: str, seed: int | None = None) -> list[str]:
    return (["env", f"PYTHONHASHSEED={seed}"] if seed is not None else []) + [sys.executable, str(SCRIPT), *args]


def resume_bisect(tmp_path_factory, name: str, *fault: str) -> dict:
    """A (runs through, saves its checkpoint at iteration K) against B (resumes it with the fault)."""
    work = tmp_path_factory.mktemp(name)
    ckpt = str(work / "ckpt")
    a = python("--save-at", str(K), "--ckpt", ckpt, *fault[1:])
    b = python("--init-from", "resume", "--ckpt", ckpt, "--fault", *fault)
    return bisect(a, b, out=work / "out", b_step_offset=K, run_timeout=300).to_dict()


def seeded_bisect(tmp_path_factory, name: str, *args: str) -> dict:
    """The same command under two hash seeds (each side repeats itself)."""
    work = tmp_path_factory.mktemp(name)
    return bisect(python(*args, seed=0), python(*args, seed=2), out=work / "out", run_timeout=300).to_dict()


def assert_consistent(result: dict) -> None:
    """No conclusion contradicts an earlier stage: an origin phase found at the conclusion's
    step bounds the conclusion's phase (or it is about the state the step started from)."""
    origin = result["origin"]
    if origin["kind"] in ("resume_state", "not_localised"):
        return
    for stage in result["stages"]:
        found = stage["finding"]
        if found and found["classification"] == "origin" and found["step"] == origin["step"]:
            assert found["phase"] == origin["phase"], (stage["name"], result["conclusion"])


@pytest.fixture(scope="module")
def forgot_optimizer(tmp_path_factory):
    return resume_bisect(tmp_path_factory, "optimizer", "optimizer")


@pytest.fixture(scope="module")
def forgot_iteration_no_logging(tmp_path_factory):
    return resume_bisect(tmp_path_factory, "iter", "iter", "--log-interval", "0")


@pytest.fixture(scope="module")
def forgot_momentum(tmp_path_factory):
    return resume_bisect(tmp_path_factory, "sgd", "optimizer", "--optimizer", "sgd")


@pytest.fixture(scope="module")
def clip_over_a_set(tmp_path_factory):
    return seeded_bisect(tmp_path_factory, "clip", "--fault", "clip-set", "--max-iters", "3", "--eval-interval", "9")


@pytest.fixture(scope="module")
def groups_from_a_set(tmp_path_factory):
    return seeded_bisect(tmp_path_factory, "groups", "--fault", "groups-set", "--max-iters", "2")


def test_a_resume_that_forgets_the_optimizer_state_names_it(forgot_optimizer):
    """Stage 1: the optimizer's output differs from the same gradients and parameters; the
    census at step K's start (the optimizer is in it from its construction) says its step
    counts differ.  Before: control_flow at the logging line's `loss.item()`."""
    result = forgot_optimizer
    origin = result["origin"]
    assert result["verdict"] == "diverged"
    assert result["stages"][0]["finding"]["phase"] == "optimizer"
    assert (origin["kind"], origin["step"]) == ("resume_state", K), result["conclusion"]
    assert origin["state_differs"] == ["optim0.step"]
    assert "optimizer 0 step counts differ" in result["conclusion"]
    assert "_local_scalar_dense" not in result["conclusion"]
    assert_consistent(result)


def test_a_resume_that_forgets_the_iteration_counter_names_the_lr(forgot_iteration_no_logging):
    """The LR is computed from the iteration counter, which restarts at 0; with logging off
    (before: control_flow, the eval's aten::zeros against the pre-loop prefetch's randint)."""
    result = forgot_iteration_no_logging
    origin = result["origin"]
    assert (origin["kind"], origin["step"]) == ("resume_state", K), result["conclusion"]
    assert origin["state_differs"] == ["optim0.lr"]
    assert "randint" not in result["conclusion"] and "zeros" not in result["conclusion"]
    assert_consistent(result)


@pytest.mark.slow
def test_a_resume_aligned_on_phases_finds_the_optimizer_state(forgot_momentum):
    """SGD's momentum has no step count, so the census cannot tell: rung 3 traces the whole
    model.  Aligned on the phases (a's logging and b's start-up, phase "pre", dropped and said
    so), the runs part inside the optimizer step that stages 1-2 pointed at."""
    result = forgot_momentum
    origin = result["origin"]
    assert [s["name"] for s in result["stages"]] == ["steps", "modules", "ops"]
    assert [s["finding"]["phase"] for s in result["stages"]] == ["optimizer"] * 3
    assert (origin["kind"], origin["phase"], origin["step"]) == ("resume_state", "optimizer", K), \
        result["conclusion"]
    assert "optimizer's own state" in result["conclusion"]
    assert origin["call_site"].endswith(f"nanogpt.py:{line_of('optimizer.step()')} in <module>")
    assert any("phase pre" in note and "not compared" in note for note in result["notes"]), result["notes"]
    assert_consistent(result)


@pytest.mark.slow
def test_clip_grad_norm_over_a_set_is_order_at_the_clip_line(clip_over_a_set):
    """The gradients reach `_foreach_norm` in another order: kind order at the clip line,
    never "all inputs matched" (before: an op origin whose "inputs matched", while its own
    dump showed them differ)."""
    result = clip_over_a_set
    origin = result["origin"]
    assert result["compared"] == "a vs b" and result["repeatable"] == {"a": True, "b": True}
    assert (origin["kind"], origin["op"], origin["phase"]) == ("order", "aten::_foreach_norm", "reduce"), \
        result["conclusion"]
    assert origin["call_site"].endswith(f"nanogpt.py:{line_of('clip_grad_norm_(')} in <module>")
    assert result["conclusion"].startswith("same values, different order")
    assert "holds the same 28 tensors" in result["conclusion"]
    assert "all inputs" not in result["conclusion"]
    assert_consistent(result)


def test_param_groups_from_a_set_name_the_optimizers_parameters(groups_from_a_set):
    """Same values, the optimizer's parameters in another order: named, with where it was built
    (before: "the runs recorded the same values in a different order: nothing to narrow")."""
    result = groups_from_a_set
    origin = result["origin"]
    assert (origin["kind"], origin["step"]) == ("order", 0), result["conclusion"]
    assert "the optimizer's parameters are in another order" in result["conclusion"]
    assert origin["call_site"].endswith(f"nanogpt.py:{line_of('torch.optim.AdamW(')} in configure_optimizers")
    assert f"nanogpt.py:{line_of('torch.optim.AdamW(')}" in result["conclusion"]
    assert_consistent(result)
