"""Shared fixtures: synthetic runs with a divergence planted where the test says."""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET once, at its first import, and any module may import it
# (torch._inductor does): set it before anything else so the kernel tests run on the CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import samebits
from _hygiene import exits_at_import


def pytest_sessionstart(session):
    found = exits_at_import()
    if found:  # importing such a file would end the session with exit code 0, nothing run
        pytest.exit(f"exit call at import in {', '.join(found)}: move it under `if __name__ == \"__main__\":`",
                    returncode=1)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (the README's ``-n auto --dist loadfile``), each worker runs the long
    tests first, so that the short ones fill the gaps at the end instead of one long test
    running alone.  ``--dist loadfile`` keeps each test file on one worker, so a module-scoped
    fixture (a recipe verify, a torchrun of every cell) runs once."""
    if hasattr(config, "workerinput"):  # an xdist worker (all workers sort alike)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def write_run(directory, *, world_size=2, num_steps=5, num_tensors=4, plant=None, config=None,
              stop_after=None, ranks=None, seed=0):
    """Write a synthetic run: per step, metrics then ``num_tensors`` grads and params.

    ``plant=(step, rank, phase, name)`` flips one bit of that tensor (or metric) there.
    ``stop_after=(rank, step)`` ends that rank's stream after that step.
    """
    for rank in ranks if ranks is not None else range(world_size):
        gen = torch.Generator().manual_seed(seed + rank)
        params = {f"layer{i}.weight": torch.randn(3 + i, 5, generator=gen) for i in range(num_tensors)}
        with samebits.Recorder(directory, rank=rank, world_size=world_size,
                               config=config if config is not None else {"lr": 0.1}) as rec:
            for step in range(num_steps):
                loss = float(sum(p.sum() for p in params.values()))
                if plant and plant[:3] == (step, rank, "metrics") and plant[3] == "loss":
                    loss = torch.tensor(loss, dtype=torch.float64).view(torch.int64).add(1).view(torch.float64).item()
                rec.metrics(step, loss=loss, grad_norm=1.5)
                grads = {n: p * 0.01 for n, p in params.items()}
                for phase, named in (("grads", grads), ("params", params)):
                    named = dict(named)
                    if plant and plant[:3] == (step, rank, phase):
                        t = named[plant[3]].clone()
                        t.view(torch.int32).view(-1)[0] ^= 1
                        named[plant[3]] = t
                    rec.tensors(step, phase, named.items())
                for n in params:
                    params[n] = params[n] - grads[n]
                if stop_after is not None and stop_after == (rank, step):
                    break


@pytest.fixture
def make_run(tmp_path):
    counter = iter(range(1000))

    def make(**kwargs):
        directory = tmp_path / f"run{next(counter)}"
        write_run(directory, **kwargs)
        return directory

    return make
