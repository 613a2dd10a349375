"""A user's data-parallel script (2 ranks forked, gloo): it seeds with `seed + rank` before
building the model, meaning to vary the data, so the replicas start from different weights;
gradients are averaged by hand, weights never broadcast.  Every run repeats the same bits."""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world_size, init_method):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    torch.manual_seed(0 + rank)  # PLANTED: the weights should be the same on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1 + rank)
    for step in range(2):
        loss = model(torch.randn(4, 8, generator=data)).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    init = "file://" + os.path.join(tempfile.mkdtemp(), "init")
    mp.start_processes(worker, args=(2, init), nprocs=2, start_method="fork")
