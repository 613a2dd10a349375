"""DP-replica consistency on 2 gloo ranks: a planted one-bit difference in one parameter (or
optimizer state) of one rank is caught and named; equal replicas pass; DTensor placements
decide what is a replica (Replicate dims only); the periodic hook fires on its steps."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import samebits
from samebits.errors import ConfigError
from samebits.replicas import ReplicaCheck, ReplicaMismatchError, check_replicas

pytestmark = pytest.mark.slow  # two gloo processes (one spawn for the module)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on every rank: DDP-like replicas
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _flip_one_bit(tensor: torch.Tensor, index: int = 3) -> None:
    with torch.no_grad():
        tensor.view(-1).view(torch.int32)[index] ^= 1 << 7


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    found = {}
    try:
        model = _model()
        found["equal"] = check_replicas(model).to_dict()
        if rank == 1:
            _flip_one_bit(model[2].weight)
        found["flipped"] = check_replicas(model).to_dict()

        # optimizer state: equal parameters, one bit of one Adam moment differs on rank 1
        model = _model()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        if rank == 1:
            _flip_one_bit(opt.state[model[0].bias]["exp_avg_sq"], 0)
        found["optimizer_without"] = check_replicas(model).verdict.value
        found["optimizer"] = check_replicas(model, optimizer=opt).to_dict()

        # DTensor: a Replicate parameter is a replica, a Shard one is not (its shards differ)
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(16, dtype=torch.float32).reshape(4, 4)
        replicated = distribute_tensor(full, mesh, [Replicate()])
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        found["dtensor_equal"] = check_replicas({"rep": replicated, "shard": sharded}).to_dict()
        if rank == 0:
            _flip_one_bit(replicated.to_local(), 5)
        found["dtensor_flipped"] = check_replicas({"rep": replicated, "shard": sharded}).to_dict()
        found["dtensor_sharded_only"] = check_replicas({"shard": sharded}).to_dict()

        # the hook: checks at multiples of `every`, raises on every rank on a mismatch
        model = _model()
        check = ReplicaCheck(model, every=2)
        fired = []
        for step in range(5):
            if step == 3 and rank == 0:
                _flip_one_bit(model[0].weight, 1)
            try:
                fired.append((step, None if check.step(step) is None else "pass"))
            except ReplicaMismatchError as err:
                fired.append((step, "mismatch: " + err.report.mismatches[0].name))
                break
        found["hook"] = fired
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as file:
        json.dump(found, file)
    # Everything is written. Skip the C++ static destructors: under load a gloo process
    # occasionally aborts there (SIGABRT, "terminate called without an active exception").
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("replicas") / "found")
    mp.spawn(_worker, args=(2, _free_port(), out), nprocs=2, join=True)
    return [json.load(open(f"{out}.{rank}")) for rank in range(2)]


def test_equal_replicas_pass(results):
    for found in results:
        assert found["equal"]["verdict"] == "pass" and found["equal"]["num_tensors"] == 4
        assert found["equal"]["mismatches"] == []


def test_one_bit_on_one_rank_is_caught_and_named(results):
    for found in results:  # the same report on both ranks
        report = found["flipped"]
        assert report["verdict"] == "fail" and report["exit_code"] == 1
        [mismatch] = report["mismatches"]
        assert mismatch["name"] == "2.weight" and mismatch["group"] == [0, 1]
        # two replicas: a tie; the lowest rank's value is the reference
        assert mismatch["ranks"] == [1]
        assert mismatch["digests"]["0"] != mismatch["digests"]["1"]


def test_optimizer_state_is_checked_when_asked(results):
    for found in results:
        assert found["optimizer_without"] == "pass"  # parameters alone are equal
        report = found["optimizer"]
        assert report["verdict"] == "fail"
        assert [m["name"] for m in report["mismatches"]] == ["optimizer/0.bias/exp_avg_sq"]


def test_dtensor_only_replicate_dims_are_replicas(results):
    for found in results:
        assert found["dtensor_equal"]["verdict"] == "pass"
        assert found["dtensor_equal"]["not_replicated"] == ["shard"]  # its shards differ, by design
        flipped = found["dtensor_flipped"]
        # rank 0 flipped; with two replicas there is no majority: the report says so
        assert [(m["name"], m["ranks"], m["tie"]) for m in flipped["mismatches"]] == [("rep", [1], True)]
        assert found["dtensor_sharded_only"]["verdict"] == "incomplete"  # nothing compared: never a pass


def test_hook_fires_on_its_steps_and_stops_training(results):
    for found in results:
        assert found["hook"] == [[0, "pass"], [1, None], [2, "pass"], [3, None], [4, "mismatch: 0.weight"]]


def test_needs_a_process_group_and_a_positive_interval():
    with pytest.raises(ConfigError, match="torch.distributed"):
        samebits.check_replicas(_model())
    with pytest.raises(ConfigError, match="every"):
        samebits.ReplicaCheck(_model(), every=0)
