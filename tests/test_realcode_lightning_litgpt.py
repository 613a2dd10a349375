"""The unmodified Lightning and litgpt runs of the real-code corpus under `samebits verify`, end to end.

Each runs its trainer's own entry point (lightning.Trainer.fit with `ckpt_path`; litgpt's CLI
`pretrain` with `--resume`) three times through the benchmark's own case runner: A and B must be
identical and the resume from A's step-4 checkpoint must equal A from there on (the control cases
`lightning_unmodified` and `litgpt_unmodified` of tests/realcode/*/cases.json).  A FAIL here is a
false alarm on real code; a crash is samebits breaking the program.  Slow: a few minutes on CPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("_bench_detection", ROOT / "benchmarks" / "bench_detection.py")
bench = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = bench  # its dataclasses look their module up while the class is made
_SPEC.loader.exec_module(bench)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["lightning", "litgpt"])
def test_unmodified_trainer_verifies_with_its_exact_resume(trainer):
    corpus = bench.load_corpus(ROOT / "tests" / "realcode" / trainer / "cases.json")
    case = next(c for c in corpus.cases if c["name"] == f"{trainer}_unmodified")
    missing = bench.missing_requirements(case)
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (the pins are in tests/realcode/README.md)")
    score = bench.run_case(case, timeout=900, corpus=corpus.folder, label=corpus.label)
    assert score.outcome == "hit", (score.got, score.why, score.said)
