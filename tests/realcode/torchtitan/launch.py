"""Run torchtitan 0.3.0's own, unmodified training entry point on CPU (gloo), 1 or more ranks.

torchtitan assumes an accelerator.  This launcher changes only what stands between its code
and a CPU, then calls `torchtitan.train.main()` as `python -m torchtitan.train` would:

* its device is `_get_available_device_type() or "cuda"`: we make that `"cpu"` (so its device
  module is `torch.cpu` and its process group backend gloo);
* its memory monitor calls `get_device_name`, `get_device_properties(...).total_memory`,
  `memory_stats`, `reset_peak_memory_stats` and `empty_cache` on the device module: `torch.cpu`
  gets those (no-ops, or zeros), and a `current_device()` that gloo's barrier accepts;
* after step 1 it calls `torch.distributed.set_timeout`, which torch 2.13 lacks: a no-op;
* it sets FSDP's gradient divide factor to 1.0 (it scales by the global token count itself),
  which FSDP reduce-scatters with `PREMUL_SUM(1/1.0)`, an op gloo lacks: on 2+ ranks FSDP is
  told to reduce with SUM and divide by nothing instead (its own `force_sum_reduction_for_comms`
  path; multiplying by 1.0 is exact, so the sums are the same);
* its debug config reads a tokenizer and a `c4_test` dataset that the wheel does not ship:
  made here (assets.py) under DUMP/assets, with the Hugging Face libraries kept offline.

One rank (the launcher sets the env torchrun would) or several through torchrun:

    python launch.py --module tiny_llama3 --config tiny --dump_folder OUT
    python -m torch.distributed.run --standalone --nproc-per-node 2 launch.py --module tiny_llama3 --config tiny --dump_folder OUT
    # resume from another run's checkpoint of step K into a fresh folder:
    python launch.py --module tiny_llama3 --config tiny --dump_folder OUT2 \
        --checkpoint.initial_load_path OUT/checkpoint/step-K --checkpoint.no-initial-load-model-only

Everything after the script name is torchtitan's own command line.  A planted-fault wrapper
imports this module, calls `prepare()`, patches one method of torchtitan and calls `run()`.
"""
from __future__ import annotations

import os
import socket
import sys
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _dump_folder(argv: list[str]) -> str:
    """The `--dump_folder` torchtitan will write to (it must be given: the assets go there)."""
    for i, arg in enumerate(argv):
        for flag in ("--dump_folder", "--dump-folder"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    raise SystemExit(f"{Path(__file__).name}: give --dump_folder DIR (torchtitan's output folder; "
                     "the tokenizer and dataset are made under DIR/assets)")


def _single_process_env() -> None:
    """Without torchrun: the env torchrun would set for one rank (torchtitan reads LOCAL_RANK etc.)."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _cpu_shims() -> None:
    """Make torchtitan's device `cpu`, give `torch.cpu` the calls its code makes on a device module,
    and keep FSDP's reduce-scatter within what gloo offers."""
    import torch
    import torch._utils
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    torch._utils._get_available_device_type = lambda: "cpu"
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
        name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None
    cpu.current_device = lambda: 0  # an index, as barrier(device_ids=[...]) expects
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None

    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def sum_when_factor_is_one(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="",
                               factor=None, force_sum_reduction_for_comms=False):
        return divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, factor,
                              force_sum_reduction_for_comms or factor == 1.0)

    _fsdp_collectives._get_gradient_divide_factors = sum_when_factor_is_one


def prepare(argv: list[str] | None = None) -> None:
    """Everything before torchtitan's own code: env, CPU shims, assets, the config module on sys.path."""
    from assets import make_assets

    argv = sys.argv[1:] if argv is None else argv
    dump = Path(_dump_folder(argv)).resolve()
    assets = make_assets(dump / "assets")
    os.environ["TINY_LLAMA3_ASSETS"] = str(assets)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_CACHE", str(assets / "hf_cache"))
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    _single_process_env()
    _cpu_shims()
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


def run() -> None:
    """torchtitan's own entry point, as `python -m torchtitan.train` runs it."""
    from torchtitan.train import main

    main()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    prepare()
    run()
