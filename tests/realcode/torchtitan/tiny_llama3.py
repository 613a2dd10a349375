"""Config functions for torchtitan's `--module tiny_llama3 --config NAME` registry.

Each returns torchtitan's own `llama3_debugmodel()` job config, made small enough for a CPU:
2 of its 6 layers, SDPA inner attention (FlexAttention has no CPU backward), float32
parameters, FSDP2 through its `partial_dtensor` backend, batch 4 of 128 tokens, 10 steps, a full checkpoint every 4 steps (torchtitan writes `step-4`, `step-8` and
`step-10` under `DUMP/checkpoint`), a fixed seed and torchtitan's deterministic mode.  Its
activation checkpointing (selective), FSDP2 wrapping, optimizer and LR schedule containers,
data loader and checkpointer are torchtitan's defaults, untouched.  The dump folder comes from
the command line (`--dump_folder DIR`); the tokenizer and dataset come from the folder the
launcher made (env TINY_LLAMA3_ASSETS, see launch.py).

The `*_exclude_*` configs plant a resume fault through torchtitan's own knob
`checkpoint.exclude_from_loading`: a fresh run is unaffected, a resumed run does not load
that piece of state.
"""
from __future__ import annotations

import os

from torchtitan.config import DebugConfig
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3.config_registry import llama3_debugmodel

NUM_LAYERS = 2
STEPS = 10
CHECKPOINT_INTERVAL = 4


def _assets() -> str:
    folder = os.environ.get("TINY_LLAMA3_ASSETS")
    if not folder:
        raise ValueError("TINY_LLAMA3_ASSETS is not set: run torchtitan through "
                         "tests/realcode/torchtitan/launch.py, which makes the tokenizer and dataset")
    return folder


def tiny() -> object:
    """torchtitan's llama3 debug model on CPU: 2 layers, SDPA, 10 steps, checkpoints at 4 and 8."""
    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:NUM_LAYERS]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    assets = _assets()
    config.hf_assets_path = os.path.join(assets, "tokenizer")
    config.dataloader.dataset_path = os.path.join(assets, "c4_test")
    config.training.local_batch_size = 4
    config.training.seq_len = 128
    config.training.steps = STEPS
    # float32 parameters: bf16 (the debug config's GPU choice) is slow on a CPU, and CPU kernels
    # take their parallel (order-dependent) paths only in float32
    config.training.mixed_precision_param = "float32"
    # the classic FSDP2 path: torchtitan 0.3.0's default "spmd_types" backend stops on 2 CPU ranks
    # in fully_shard ("all parameters must be DTensors on the full SPMD mesh")
    config.parallelism.spmd_backend = "partial_dtensor"
    config.validator.enable = False
    config.checkpoint.enable = True
    config.checkpoint.interval = CHECKPOINT_INTERVAL
    config.debug = DebugConfig(seed=0, deterministic=True)
    return config


def tiny_exclude_optimizer() -> object:
    """`tiny`, whose resume does not load the optimizer (AdamW restarts with empty moments)."""
    config = tiny()
    config.checkpoint.exclude_from_loading = ["optimizer"]  # PLANTED
    return config


def tiny_exclude_lr_scheduler() -> object:
    """`tiny`, whose resume does not load the LR schedulers (the warmup/decay count restarts)."""
    config = tiny()
    config.checkpoint.exclude_from_loading = ["lr_scheduler"]  # PLANTED
    return config


def tiny_exclude_dataloader() -> object:
    """`tiny`, whose resume does not load the data loader (it restarts at the first sample)."""
    config = tiny()
    config.checkpoint.exclude_from_loading = ["dataloader"]  # PLANTED
    return config


def tiny_exclude_train_state() -> object:
    """`tiny`, whose resume does not load train_state (the step counter restarts at 0)."""
    config = tiny()
    config.checkpoint.exclude_from_loading = ["train_state"]  # PLANTED
    return config


def tiny_invariant() -> object:
    """`tiny` with samebits' config: the same bits at any FSDP2 degree (SAMEBITS_LAYOUT sets the
    layout, SAMEBITS_INVARIANT=0 keeps torchtitan's own step).  A global batch of 8 in
    micro-batches of 2 (4 on one rank, 2 a rank on 2, 1 on 4), 20 steps, a checkpoint every 10."""
    from samebits.integrations.torchtitan import invariant

    config = tiny()
    config.training.local_batch_size = 2
    config.training.global_batch_size = 8
    config.training.steps = 20
    config.checkpoint.interval = 10
    return invariant(config)


def tiny_invariant_dp() -> object:
    """`tiny_invariant` with torchtitan's own layers (``tensor_parallel=False``): the same bits at
    any data-parallel layout only, for less; tensor parallelism is refused."""
    from samebits.integrations.torchtitan import invariant

    config = tiny()
    config.training.local_batch_size = 2
    config.training.global_batch_size = 8
    config.training.steps = 20
    config.checkpoint.interval = 10
    return invariant(config, tensor_parallel=False)
