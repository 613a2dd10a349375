"""Run a program as ``python PROGRAM ARGS...`` would, and write the digests of its final
parameters as the process ends (tests/test_transparency.py compares them with and without
`samebits run`).  The program is not changed: it runs through `runpy` as ``__main__``.

    python final_params.py PROGRAM [ARGS...]      # FINAL_PARAMS_OUT=PREFIX in the environment

Which parameters: every parameter an optimizer stepped (held from its steps, so that those of a
model local to ``main()`` still count) and every parameter of a module alive at exit.  They are
written as their sorted SHA-256 digests (dtype, shape and bytes), so that the order in which they
were found does not matter, to ``PREFIX.rank<RANK>.json`` (rank 0 without torchrun)."""

import atexit
import gc
import hashlib
import json
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_stepped: dict[int, torch.Tensor] = {}  # id -> parameter, held so that the id stays its own


def _note_step(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        for param in group["params"]:
            _stepped.setdefault(id(param), param)


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1)
    raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
    header = f"{data.dtype}:{tuple(tensor.shape)}:".encode()
    return hashlib.sha256(header + raw).hexdigest()


def _write() -> None:
    params = dict(_stepped)
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.nn.Module):
                for param in obj._parameters.values():
                    if param is not None:
                        params.setdefault(id(param), param)
        except Exception:  # noqa: BLE001 - an odd object (a proxy) is not a module
            continue
    digests = sorted(_digest(p) for p in params.values())
    rank = os.environ.get("RANK", "0")
    with open(f"{os.environ['FINAL_PARAMS_OUT']}.rank{rank}.json", "w", encoding="utf-8") as handle:
        json.dump({"count": len(digests), "steps_seen": bool(_stepped), "digests": digests}, handle)


register_optimizer_step_post_hook(_note_step)
atexit.register(_write)  # registered before the program's own: runs after them
program = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(program))  # as `python PROGRAM` sets it
_held = None  # an exception that ends the program: its frames keep the program's objects alive
try:
    _globals = runpy.run_path(program, run_name="__main__")
except BaseException as error:
    _held = error
    raise
