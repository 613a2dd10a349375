"""The worker of tests/test_global_digest.py: one of 4 gloo ranks that serve cases read as
JSON lines on stdin (one answer line each), so one process group serves every example.

Run as ``python tests/global_digest_worker.py`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set.  Imports only what the cases need (start-up time is per test run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import samebits
from samebits.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8,
          "bool": torch.bool, "float64": torch.float64, "complex128": torch.complex128}


def full_tensor(seed: int, shape, dtype_name: str) -> torch.Tensor:
    """The case's full tensor, the same in every process."""
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[dtype_name]
    if dtype in (torch.int8, torch.bool):
        return torch.randint(-100, 100, tuple(shape), generator=gen).to(dtype)
    if dtype.is_complex:
        return torch.randn(tuple(shape), generator=gen, dtype=torch.complex128)
    return (torch.randn(tuple(shape), generator=gen) * 100).to(dtype)


def make_placements(spec):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = []
    for p in spec:
        if p is None:
            out.append(Replicate())
        elif p[0] == "S":
            out.append(Shard(p[1]))
        else:
            out.append(_StridedShard(p[1], split_factor=p[2]))
    return out


def train(directory, *, rank, world_size, tp_mesh=None, plant=None, num_steps=3):
    """Two Linear layers, 3 SGD steps; records global params and grads, and one local record."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if tp_mesh is not None:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    with samebits.Recorder(directory, rank=rank, world_size=world_size, config={"tp": world_size}) as rec:
        for step in range(num_steps):
            rec.global_tensors(step, "params", model.named_parameters())
            loss = model(data).square().mean()
            loss.backward()
            rec.global_tensors(step, "grads", ((n, p.grad) for n, p in model.named_parameters()))
            rec.metrics(step, loss=loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            if plant is not None and plant[0] == step and rank == plant[1]:  # one bit, one shard
                weight = model[2].weight
                local = weight.to_local() if hasattr(weight, "to_local") else weight
                with torch.no_grad():
                    local.view(-1).view(torch.int32)[0] ^= 1




def _worker() -> None:  # pragma: no cover - runs in the subprocesses
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, distribute_tensor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meshes = {"w4": init_device_mesh("cpu", (4,)), "2x2": init_device_mesh("cpu", (2, 2)),
              "w2": DeviceMesh("cpu", [0, 1]), "1x2": DeviceMesh("cpu", [[0, 1]])}
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = _serve(request, rank, meshes, distribute_tensor, Partial, Replicate)
        except Exception as err:  # report, keep serving
            import traceback

            answer = {"error": f"{type(err).__name__}: {err}\n{traceback.format_exc()}"}
        print(json.dumps(answer), flush=True)
    # No destroy_process_group(): its barrier would wait for every rank; exiting is enough.


def _serve(request, rank, meshes, distribute_tensor, Partial, Replicate):
    import torch.distributed as dist

    if request["cmd"] == "dtensor":
        mesh = meshes[request["mesh"]]
        if mesh.get_coordinate() is None:
            return None
        full = full_tensor(request["seed"], request["shape"], request["dtype"])
        x = distribute_tensor(full, mesh, make_placements(request["placements"]), src_data_rank=None)
        digest = samebits.global_digests([("x", x)])["x"]
        local = x.to_local()
        if rank == 0 and local.numel():  # plant one bit in rank 0's shard
            data = local.reshape(-1).view(torch.uint8)
            data[request["flip"] // 8 % data.numel()] ^= 1 << (request["flip"] % 8)
        flipped = samebits.global_digests([("x", x)])["x"]
        return {"digest": digest, "flipped": flipped, "rank0_numel": int(dist.get_rank() == 0 and local.numel())
                or None}
    if request["cmd"] == "megatron":
        world = dist.get_world_size()
        out = {"digests": {}, "expected": {}}
        for name, shape, dim, dtype in (("col", (8, 5), 0, "bfloat16"), ("row", (3, 12), 1, "int8"),
                                        ("odd", (2, 4), 1, "float16")):
            full = full_tensor(7, shape, dtype)
            local = full.chunk(world, dim)[rank].clone()
            local.tensor_model_parallel, local.partition_dim, local.partition_stride = True, dim, 1
            out["digests"][name] = samebits.global_digests([(name, local)], group=dist.group.WORLD)[name]
            out["expected"][name] = samebits.digest(full)
        from torch.distributed.tensor import DTensor

        x = DTensor.from_local(torch.ones(4), meshes["w4"], [Partial()])  # a pending sum
        for key, call in (("partial_error", lambda: samebits.global_digests([("p", x)])),
                          ("mismatch_error", lambda: samebits.global_digests(
                              [(f"w{rank % 2}", distribute_tensor(torch.ones(4), meshes["w4"],
                                                                  make_placements([("S", 0)])))])),
                          ("no_group_error", lambda: samebits.global_digests([("col", local)]))):
            try:
                call()
                out[key] = "no error"
            except ConfigError as err:
                out[key] = str(err)
        return out
    if request["cmd"] == "fsdp":  # FSDP2 on ranks 0, 1: uneven Shard(0) of bf16 parameters
        from torch.distributed.fsdp import fully_shard

        mesh = meshes["w2"]
        if mesh.get_coordinate() is None:
            return None
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7)).to(torch.bfloat16)
        full = {name: samebits.digest(p) for name, p in model.named_parameters()}
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return {"full": full, "global": samebits.global_digests(model.named_parameters()),
                "local_shapes": [list(p.to_local().shape) for p in model.parameters()]}
    if request["cmd"] == "train":
        mesh = meshes["w2"]
        if mesh.get_coordinate() is None:
            return "ok"
        plant = tuple(request["plant"]) if request.get("plant") else None
        train(Path(request["dir"]), rank=rank, world_size=2, tp_mesh=mesh, plant=plant)
        return "ok"
    raise ValueError(request["cmd"])


if __name__ == "__main__":
    _worker()
