"""Comparison at scale: rank walks in parallel processes give exactly the serial result;
the distributed comparison under torchrun (4 gloo processes); the summary of many ranks;
the synthetic generator's streams pass every check of the comparator."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import samebits
from samebits.cli import main
from samebits.errors import ConfigError, StreamError
from samebits.stream import _format as fmt

ROOT = Path(__file__).resolve().parent.parent


def _write(directory, *, world_size, num_steps=6, differ=None, stop_after=None, config=None):
    """A run whose rank r records values that differ from step ``differ[r]`` on (every
    record of the step and later ones); ``stop_after=(rank, step)`` cuts that rank short."""
    differ = differ or {}
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(rank)
        params = [torch.randn(4, 3, generator=gen) for _ in range(3)]
        with samebits.Recorder(directory, rank=rank, world_size=world_size, config=config or {"lr": 0.1}) as rec:
            for step in range(num_steps):
                bump = rank in differ and step >= differ[rank]
                values = [torch.nextafter(p, p + 1) if bump else p for p in params]
                rec.metrics(step, loss=float(sum(v.sum() for v in values)))
                rec.tensors(step, "params", [(f"w{i}", v) for i, v in enumerate(values)])
                params = [p * 0.5 for p in params]
                if stop_after == (rank, step):
                    break
    return directory


# Ranks diverge at steps 5, 2, -, 4, 1, 3: the serial walk's bound (earliest divergence so
# far) makes the later ranks stop early, so the parallel merge must re-walk some of them.
SCATTERED = {0: 5, 1: 2, 3: 4, 4: 1, 5: 3}


@pytest.mark.parametrize("case", ["identical", "scattered", "truncated", "one_late"])
def test_parallel_walk_equals_serial(tmp_path, case):
    world = 7
    a = _write(tmp_path / "a", world_size=world)
    kwargs = {"identical": {}, "scattered": {"differ": SCATTERED}, "truncated": {"stop_after": (2, 3)},
              "one_late": {"differ": {6: 5}, "stop_after": (3, 2)}}[case]
    b = _write(tmp_path / "b", world_size=world, **kwargs)
    serial = samebits.diff(a, b, jobs=1)
    for jobs in (2, 3):
        parallel = samebits.diff(a, b, jobs=jobs)
        assert parallel == serial, (case, jobs)
        assert parallel.to_dict() == serial.to_dict()
    expected = {"identical": "identical", "scattered": "diverged", "truncated": "diverged",
                "one_late": "diverged"}[case]
    assert serial.verdict == expected
    if case == "scattered":
        # Serial semantics kept: rank 0 (walked before any bound) keeps its step-5 divergence;
        # rank 3 (step 4) is past rank 1's bound (2) and is not reported.
        assert sorted(serial.divergences) == [0, 1, 4]
        assert (serial.first_divergence.step, serial.first_divergence.rank) == (1, 4)


def test_parallel_damaged_stream_is_an_error_as_in_serial(tmp_path):
    a = _write(tmp_path / "a", world_size=4)
    b = _write(tmp_path / "b", world_size=4, differ={3: 1})
    path = b / fmt.stream_filename(2)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a checksum mismatch in the middle of rank 2
    path.write_bytes(bytes(data))
    errors = []
    for jobs in (1, 2):
        with pytest.raises(StreamError) as caught:
            samebits.diff(a, b, jobs=jobs)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] and "rank-00002.sbs" in errors[0]


def test_jobs_option_is_checked(tmp_path):
    a = _write(tmp_path / "a", world_size=2, num_steps=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="jobs"):
            samebits.diff(a, a, jobs=bad)
    assert main(["diff", str(a), str(a), "--jobs", "0"]) == 2


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_scale_runs", ROOT / "benchmarks" / "gen_scale_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pairs_are_genuine_streams(tmp_path):
    info = _load_generator().generate(tmp_path / "runs", num_ranks=6, num_steps=8, num_records=5, early_rank=2)
    paths = info["paths"]
    identical = samebits.diff(paths["a"], paths["b"], verify=True, jobs=2)
    assert identical.verdict == "identical" and identical.compared["records"] == 6 * 8 * 5
    last = samebits.diff(paths["a"], paths["b-last"], jobs=2)
    d = last.first_divergence
    assert (d.step, d.rank, d.records_differing) == (7, 5, 1)
    early = samebits.diff(paths["a"], paths["b-early"])
    assert (early.first_divergence.step, early.first_divergence.rank) == (3, 2)
    assert early.ranks_diverged_first == [2]


@pytest.mark.slow
def test_distributed_comparison_under_torchrun(tmp_path):
    """4 gloo processes under torchrun, each comparing a slice of the ranks: process 0
    prints the verdict; the JSON equals the serial result."""
    a = _write(tmp_path / "a", world_size=6)
    same = _write(tmp_path / "same", world_size=6)
    other = _write(tmp_path / "other", world_size=6, differ={4: 2, 1: 5})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for b, code in ((same, 0), (other, 1)):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   "-m", "samebits", "diff", "--distributed", "--json", str(a), str(b)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        printed = json.loads(done.stdout)  # one JSON document: only process 0 printed
        assert printed == samebits.diff(a, b, jobs=1).to_dict()
        assert printed["exit_code"] == code
        assert (done.returncode == 0) == (code == 0), done.stderr[-2000:]
    assert printed["first_divergence"]["rank"] == 4 and printed["first_divergence"]["step"] == 2


def test_distributed_without_torchrun_is_a_clear_error(tmp_path, monkeypatch, capsys):
    a = _write(tmp_path / "a", world_size=2, num_steps=2)
    for var in ("MASTER_ADDR", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert main(["diff", "--distributed", str(a), str(a)]) == 2
    assert "torchrun" in capsys.readouterr().err


def test_summary_of_many_ranks_stays_short(tmp_path, capsys):
    world = 33
    a = _write(tmp_path / "a", world_size=world, num_steps=4)
    # ranks 0, 1, 2 diverge at steps 3, 2, 1; after rank 2, ranks are compared up to step 1
    # only, so the 11 ranks r = 2 mod 3 (step 1) and ranks 0 and 1 are reported
    b = _write(tmp_path / "b", world_size=world, num_steps=4, differ={r: 3 - r % 3 for r in range(world)})
    assert main(["diff", "--jobs", "1", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert out.count("\n") < 40  # 10 ranks in the table, whatever the number that diverged
    assert "ranks: 33 compared, 13 diverged (step 1: 11, step 2: 1, step 3: 1), 20 with no difference found" in out
    assert "... and 3 more rank(s), in step order (all of them: --json)" in out
    assert "ranks diverged first (step 1): 2, 5, 8, 11, 14, 17, 20, 23, 26, 29 ... (11 ranks)" in out
    assert main(["diff", "--json", str(a), str(b)]) == 1
    payload = json.loads(capsys.readouterr().out)
    assert len(payload["divergences_by_rank"]) == 13 and len(payload["first_divergence"]["ranks"]) == 11


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to list mappings")
def test_an_open_run_holds_no_stream_mapped(tmp_path):
    """At thousands of ranks a Run must not keep a mapping per stream: it reads the headers and
    closes them; a rank's stream is opened when it is read, and released when closed."""
    _write(tmp_path / "a", world_size=48, num_steps=2)

    def mapped():
        return sum(1 for line in Path("/proc/self/maps").read_text().splitlines() if str(tmp_path) in line)

    run = samebits.open_run(tmp_path / "a")
    assert len(run.headers) == 48 and mapped() == 0
    reader = run.stream(7)
    assert [block.step for block in reader.steps()] == [0, 1] and mapped() == 1
    reader.close()
    assert mapped() == 0
    assert samebits.diff(tmp_path / "a", tmp_path / "a").identical and mapped() == 0
