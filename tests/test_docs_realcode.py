"""The trainers' commands of docs/integrations.md, run as written (issue 33): each ``realcode``
block runs a trainer of the real-code corpus (tests/realcode/) under `samebits verify` with its
resume, from a fresh folder that sees the repository's ``tests/realcode``, and must PASS with both
guarantees checked.  These runs are the real-code corpus's unmodified controls too."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_SPEC = importlib.util.spec_from_file_location("docs_harness", ROOT / "tests" / "test_docs.py")
docs = importlib.util.module_from_spec(_SPEC)
sys.modules["docs_harness"] = docs  # its dataclasses look their module up by name
_SPEC.loader.exec_module(docs)

BLOCKS = [b for b in docs.ALL if b.marker == "realcode"]
TRAINER_MODULES = {"torchtitan": "torchtitan", "hf": "transformers", "accelerate": "accelerate",
                   "lightning": "lightning", "litgpt": "litgpt"}
BLOCK_TIMEOUT_S = 2400  # a verify with its resume of a trainer is three runs; a busy 2-core machine


def test_every_trainer_of_the_corpus_has_its_documented_command():
    trainers = sorted({m.group(1) for b in BLOCKS for m in re.finditer(r"tests/realcode/(\w+)/", b.body)})
    assert trainers == sorted(TRAINER_MODULES), trainers


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_documented_trainer_commands_pass(block, tmp_path):
    trainer = re.search(r"tests/realcode/(\w+)/", block.body).group(1)
    module = TRAINER_MODULES[trainer]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install -e '.[test,realcode]' (CI installs it)")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "realcode").symlink_to(ROOT / "tests" / "realcode")
    command = "\n".join(docs._logical_lines(block.body))
    argv = ["bash", "-e", "-o", "pipefail", "-c", command.replace("samebits verify ", "samebits verify --json --out v ", 1)]
    done = subprocess.run(argv, cwd=tmp_path, env=docs._environment(), capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    said = (done.stdout[-3000:] + done.stderr[-3000:])
    assert done.returncode == 0, f"{block.where}: exit {done.returncode}\n{said}"
    payload = json.loads(done.stdout)
    assert payload["verdict"] == "pass" and payload["checked"] == ["independent", "resume"], said
    assert payload["gaps"] == {}, said  # samebits recorded everything it meant to
    independent, resumed = payload["checks"]["independent"], payload["checks"]["resume"]
    assert independent["compared"]["steps"] > resumed["compared"]["steps"] > 0, said
    assert independent["compared"]["records"] > 100, said  # params, grads, optimizer state, forwards
