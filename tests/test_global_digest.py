"""Global digests of sharded tensors equal the digest of the full tensor; `diff --by global`.

Two levels:

* in one process, the layout arithmetic: every contributor's vector is built as the all-reduce
  would see it and summed here (Hypothesis over shapes, dtypes, meshes, placements);
* for real, over 4 gloo ranks started ONCE for the module (this file run as a script is the
  worker: it reads cases as JSON lines on stdin), DTensors made by ``distribute_tensor``
  (Shard on any dim, uneven, _StridedShard, Replicate, 1-D and 2-D meshes, world and
  sub-meshes), Megatron-style attributes, refusals, and an end-to-end run: the same two-layer
  model trained unsharded on 1 rank and with ColwiseParallel/RowwiseParallel on 2 ranks,
  compared with ``samebits diff --by global``.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import samebits
from samebits.cli import main as cli_main
from samebits.errors import ConfigError
from samebits.fingerprint import _global
from samebits.fingerprint._spec import finalize, header

from global_digest_worker import DTYPES, full_tensor, make_placements, train

WORKER = Path(__file__).with_name("global_digest_worker.py")
MESHES = {"w2": (2,), "w4": (4,), "2x2": (2, 2), "1x2": (1, 2)}  # w2 and 1x2 are sub-meshes of ranks 0, 1
SIZES = [0, 1, 2, 3, 5, 7, 8, 9, 13]


@st.composite
def cases(draw, meshes=tuple(MESHES)):
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.sampled_from(SIZES)) for _ in range(ndim)]
    mesh = draw(st.sampled_from(meshes))
    placements = []
    for _ in MESHES[mesh]:
        if ndim == 0 or draw(st.booleans()) and draw(st.booleans()):
            placements.append(None)
        else:
            placements.append(("S", draw(st.integers(0, ndim - 1))))
    if mesh == "2x2" and ndim and draw(st.integers(0, 4)) == 0:  # FSDP2 + TP on one dim
        dim = draw(st.integers(0, ndim - 1))
        placements = [("SS", dim, 2), ("S", dim)]
    return {"seed": draw(st.integers(0, 2**31)), "shape": shape, "dtype": draw(st.sampled_from(list(DTYPES))),
            "mesh": mesh, "placements": placements, "flip": draw(st.integers(0, 2**20))}


# -- in one process: the arithmetic of the layout -------------------------------------------


def _simulated_digest(full: torch.Tensor, sizes, placements, flip_rank_bit=None) -> int:
    """What the all-reduce computes, summed here: every mesh member's vector, added up."""
    shape = tuple(full.shape)
    vector, plan, members = None, None, list(itertools.product(*[range(s) for s in sizes]))
    for coord in members:
        mesh = _global._Mesh(tuple(sizes), tuple(placements), coord)
        plan = _global._plan(shape, full.dtype.itemsize, mesh)
        local = full
        for dim, index in enumerate(_global._dim_indices(shape, mesh, coord)):
            local = local.index_select(dim, index)
        if flip_rank_bit is not None and coord == members[0] and local.numel():
            local = local.clone()
            data = local.reshape(-1).view(torch.uint8)
            data[flip_rank_bit // 8 % data.numel()] ^= 1 << (flip_rank_bit % 8)
        part = _global._contribution([local], [plan], 5, torch.device("cpu"))
        vector = part if vector is None else vector + part
    body, ok = _global._assemble(vector, [plan], 5, len(members))
    assert bool(ok)
    return finalize(body, [header(full.dtype, shape)])[0]


@settings(max_examples=200, deadline=None)
@given(cases())
def test_layout_arithmetic_matches_the_full_digest(case):
    full = full_tensor(case["seed"], case["shape"], case["dtype"])
    placements = [None if p is None else make_placements([p])[0] for p in case["placements"]]
    assert _simulated_digest(full, MESHES[case["mesh"]], placements) == samebits.digest(full)
    if full.numel():  # one bit flipped in the first member's shard (a contributor) is seen
        flipped = _simulated_digest(full, MESHES[case["mesh"]], placements, flip_rank_bit=case["flip"])
        first_holds_data = all(len(i) for i in _global._dim_indices(
            tuple(full.shape), _global._Mesh(MESHES[case["mesh"]], tuple(placements), (0,) * len(placements)),
            (0,) * len(placements)))
        assert (flipped != samebits.digest(full)) == first_holds_data


def test_straddling_words_are_assembled_across_ranks():
    """bf16 [3, 5] split by columns 3 | 2: every row's 10 bytes cross words at 6 / 4 bytes;
    the layout lists those words as straddling, and the sum is still exact."""
    from torch.distributed.tensor import Shard

    mesh = _global._Mesh((2,), (Shard(1),), (0,))
    plan = _global._plan((3, 5), 2, mesh)
    assert plan.straddle_words.tolist() == [0, 1, 2, 3]  # bytes 6-13, 16-19 / 20-23, 26-29: all shared
    full = full_tensor(1, [3, 5], "bfloat16")
    assert _simulated_digest(full, (2,), [Shard(1)]) == samebits.digest(full)


def test_plain_tensors_are_digested_as_they_are():
    t = torch.arange(7, dtype=torch.int16)
    assert samebits.global_digests({"t": t}) == {"t": samebits.digest(t)}


def test_megatron_interleaved_partitions_are_refused():
    t = torch.zeros(4, 2)
    t.tensor_model_parallel, t.partition_dim, t.partition_stride = True, 0, 2
    with pytest.raises(ConfigError, match="partition_stride = 2"):
        samebits.global_digests([("w", t)])


def test_duplicate_names_are_refused():
    with pytest.raises(ConfigError, match="given twice"):
        samebits.global_digests([("w", torch.zeros(1)), ("w", torch.zeros(1))])


def _global_run(directory, world_size, records):
    """A run whose every rank records ``records[step][rank]``: {name: tensor or None}."""
    for rank in range(world_size):
        with samebits.Recorder(directory, rank=rank, world_size=world_size, config={"world": world_size}) as rec:
            for step, per_rank in enumerate(records):
                rec.global_tensors(step, "params", per_rank[rank].items())


def test_recorder_global_tensors_and_absent(tmp_path):
    with samebits.Recorder(tmp_path / "r", rank=0, world_size=1) as rec:
        rec.global_tensors(0, "grads", [("a", torch.ones(3)), ("b", None)])
    block = next(samebits.open_run(tmp_path / "r").stream(0).steps())
    assert [(r.phase, r.name, r.absent, r.digest) for r in block.records()] == [
        ("global:grads", "a", False, samebits.digest(torch.ones(3))), ("global:grads", "b", True, None)]


def test_diff_by_global_verdicts(tmp_path):
    x, y = torch.arange(6.0).reshape(2, 3), torch.ones(5, dtype=torch.bfloat16)
    y2 = y.clone()
    y2[4] = 2
    _global_run(tmp_path / "one", 1, [[{"x": x, "y": y}], [{"x": x, "y": y}]])
    _global_run(tmp_path / "two", 2, [[{"x": x, "y": y}] * 2, [{"x": x, "y": y}] * 2])
    _global_run(tmp_path / "late", 2, [[{"x": x, "y": y}] * 2, [{"x": x, "y": y2}] * 2])
    _global_run(tmp_path / "fewer", 2, [[{"x": x}] * 2, [{"x": x}] * 2])
    _global_run(tmp_path / "split", 2, [[{"x": x, "y": y}] * 2, [{"x": x, "y": y}, {"x": x, "y": y2}]])
    same = samebits.diff(tmp_path / "one", tmp_path / "two", by="global")
    assert same.verdict == "identical" and same.compared["steps"] == 2 and same.compared["tensors"] == 2
    late = samebits.diff(tmp_path / "one", tmp_path / "late", by="global")
    assert late.verdict == "diverged" and late.first_step == 1
    assert [(t.name, t.status, t.first_step) for t in late.tensors] == [("x", "identical", None), ("y", "differs", 1)]
    fewer = samebits.diff(tmp_path / "one", tmp_path / "fewer", by="global")
    assert [(t.name, t.status, t.first_step) for t in fewer.tensors] == [("x", "identical", None),
                                                                          ("y", "only_in_a", 0)]
    assert fewer.verdict.exit_code == 1
    split = samebits.diff(tmp_path / "one", tmp_path / "split", by="global")  # ranks of b disagree at step 1
    assert split.first_step == 1 and any("ranks 0 and 1" in note for note in split.notes)
    assert split.verdict == "diverged"
    assert [(t.name, t.status, t.first_step) for t in split.tensors] == [("x", "identical", None),
                                                                          ("y", "ranks_disagree", 1)]
    assert "ranks of run b disagree" in split.tensors[1].detail
    both = samebits.diff(tmp_path / "split", tmp_path / "split", by="global")  # the same inconsistency twice
    assert both.tensors[1].status == "ranks_disagree" and "run a and run b" in both.tensors[1].detail
    assert samebits.diff(tmp_path / "one", tmp_path / "two", by="global", start_step=2).verdict == "incomplete"
    with pytest.raises(ConfigError, match="by = 'rank'"):
        samebits.diff(tmp_path / "one", tmp_path / "two", by="rank")


# -- 4 real gloo ranks, started once --------------------------------------------------------


class _Pool:
    def __init__(self, world_size: int = 4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size),
                   OMP_NUM_THREADS="1", SAMEBITS_DISABLE="0")
        self.procs = [subprocess.Popen([sys.executable, str(WORKER)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=dict(env, RANK=str(rank)))
                      for rank in range(world_size)]
        for proc in self.procs:
            assert json.loads(proc.stdout.readline()) == "ready"

    def ask(self, request: dict) -> list:
        for proc in self.procs:
            proc.stdin.write(json.dumps(request) + "\n")
            proc.stdin.flush()
        answers = []
        for rank, proc in enumerate(self.procs):
            line = proc.stdout.readline()
            assert line, f"worker rank {rank} died (exit {proc.poll()})"
            answer = json.loads(line)
            assert not (isinstance(answer, dict) and "error" in answer), f"worker rank {rank}: {answer['error']}"
            answers.append(answer)
        return answers

    def close(self):
        for proc in self.procs:  # stateless workers: nothing to flush, so no slow shutdown either
            proc.kill()
        for proc in self.procs:
            proc.wait()


@pytest.fixture(scope="module")
def pool():
    pool = _Pool()
    yield pool
    pool.close()


@pytest.mark.slow  # 4 gloo worker processes (started once for the module)
@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_dtensor_global_digest_equals_the_full_digest(pool, case):
    full = full_tensor(case["seed"], case["shape"], case["dtype"])
    answers = [a for a in pool.ask({"cmd": "dtensor", **case}) if a is not None]
    assert len(answers) == (2 if case["mesh"] in ("w2", "1x2") else 4)
    assert all(a["digest"] == samebits.digest(full) for a in answers), (answers, samebits.digest(full))
    flipped = [a["flipped"] for a in answers]
    if not answers[0]["rank0_numel"]:
        assert set(flipped) == {samebits.digest(full)}
    elif all(p is None for p in case["placements"]):
        # Replicated everywhere: each rank digests its own copy, so rank 0's changed copy shows
        # on rank 0 only (a diff then reports that the ranks of the run disagree).
        assert flipped[0] != samebits.digest(full) and set(flipped[1:]) == {samebits.digest(full)}
    else:  # one member per replica group contributes, and every rank gets the same answer
        assert len(set(flipped)) == 1 and flipped[0] != samebits.digest(full)


@pytest.mark.slow  # 4 gloo worker processes (started once for the module)
def test_fsdp2_parameters(pool):
    answers = [a for a in pool.ask({"cmd": "fsdp"}) if a is not None]
    assert len(answers) == 2 and answers[0]["local_shapes"] != answers[1]["local_shapes"]  # uneven
    assert all(a["global"] == a["full"] for a in answers)


@pytest.mark.slow  # 4 gloo worker processes (started once for the module)
def test_megatron_shards_and_refusals(pool):
    answers = pool.ask({"cmd": "megatron"})
    for answer in answers:
        assert answer["digests"] == answer["expected"]
        assert "redistribute" in answer["partial_error"]
        assert "different tensors" in answer["mismatch_error"]
        assert "pass group=" in answer["no_group_error"]


@pytest.mark.slow  # 4 gloo worker processes (started once for the module)
def test_tp1_against_tp2_by_global_tensor(pool, tmp_path, capsys):
    train(tmp_path / "tp1", rank=0, world_size=1)
    assert pool.ask({"cmd": "train", "dir": str(tmp_path / "tp2")})[:2] == ["ok", "ok"]
    assert pool.ask({"cmd": "train", "dir": str(tmp_path / "tp2_planted"), "plant": [1, 1]})[:2] == ["ok", "ok"]

    # Same layout, one bit planted in rank 1's shard of 2.weight after step 1's update: seen at
    # step 2 (the next record), on that tensor only.
    planted = samebits.diff(tmp_path / "tp2", tmp_path / "tp2_planted", by="global")
    assert planted.verdict == "diverged" and planted.first_step == 2
    first = {(t.phase, t.name) for t in planted.differing_at_first_step}
    assert ("params", "2.weight") in first  # and the grads computed from it that step
    assert {name for phase, name in first if phase == "params"} == {"2.weight"}

    # Different layouts: the local comparison refuses (world size), the global one compares.
    with pytest.raises(samebits.IncomparableRunsError, match="--by global"):
        samebits.diff(tmp_path / "tp1", tmp_path / "tp2")
    result = samebits.diff(tmp_path / "tp1", tmp_path / "tp2", by="global")
    by_name = {(t.phase, t.name): t for t in result.tensors}
    assert len(by_name) == 8 and result.compared["steps"] == 3
    # The initial parameters agree bit for bit (the same full tensors, sharded).
    assert all(t.first_step is None or t.first_step > 0 for (phase, _), t in by_name.items() if phase == "params")
    # What the layouts change (the row-parallel layer's reduction is split over 2 ranks) is
    # reported per tensor at the step it first shows, never as IDENTICAL when it differs.
    differing = [t for t in result.tensors if t.status != "identical"]
    assert (result.verdict == "identical") == (not differing)
    if differing:
        assert result.first_step == min(t.first_step for t in differing)
    assert cli_main(["diff", "--by", "global", str(tmp_path / "tp1"), str(tmp_path / "tp2")]) == \
        result.verdict.exit_code
    out = capsys.readouterr().out
    assert "2.weight" in out and "0.bias" in out
    assert cli_main(["diff", "--by", "global", "--json", str(tmp_path / "tp1"), str(tmp_path / "tp2")]) == \
        result.verdict.exit_code
    payload = json.loads(capsys.readouterr().out)
    assert payload["by"] == "global" and len(payload["tensors"]) == 8
    # A window without global records compares nothing: exit 2, never IDENTICAL.
    empty = samebits.diff(tmp_path / "tp1", tmp_path / "tp2", by="global", start_step=50)
    assert empty.verdict == "incomplete"




def test_tensors_and_global_with_shards_records_what_the_two_calls_record(tmp_path):
    """DTensor shards (computed for the global record), a replicated DTensor and a Megatron
    tensor of a one-rank group (unsharded: the local sum reused), a plain tensor, an absent one:
    `tensors_and_global` writes what `tensors` of the local parts and `global_tensors` write."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(15.0).reshape(5, 3)
        megatron = torch.arange(4.0)
        megatron.tensor_model_parallel, megatron.partition_dim = True, 0
        named = [("shard", distribute_tensor(full, mesh, [Shard(1)])),
                 ("rep", distribute_tensor(full + 1, mesh, [Replicate()])),
                 ("megatron", megatron), ("plain", torch.ones(2, dtype=torch.bfloat16)), ("none", None)]
        with samebits.Recorder(tmp_path / "one", rank=0, world_size=1) as rec:
            for step in range(3):
                rec.tensors_and_global(step, "params", named)
        with samebits.Recorder(tmp_path / "two", rank=0, world_size=1) as rec:
            for step in range(3):
                rec.tensors(step, "params", [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named])
                rec.global_tensors(step, "params", named)
    finally:
        dist.destroy_process_group()
    one, two = (samebits.open_run(tmp_path / d).stream(0) for d in ("one", "two"))
    assert [b.root for b in one.steps()] == [b.root for b in two.steps()]
    records = list(next(samebits.open_run(tmp_path / "one").stream(0).steps()).records())
    global_ = {r.name: r.digest for r in records if r.phase == "global:params"}
    assert global_ == {"shard": samebits.digest(full), "rep": samebits.digest(full + 1),
                       "megatron": samebits.digest(megatron), "plain": samebits.digest(torch.ones(2, dtype=torch.bfloat16)),
                       "none": None}
