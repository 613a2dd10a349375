"""The built-in determinism rules: environment, torch flags and generic config keys.
Importing this module registers them.  (The reference recipe registers its own option rules
through the public API: samebits/recipes/rules.py.)"""

from __future__ import annotations

import sys
from typing import Iterator

from samebits.determinism._environment import ENV_BY_NAME, ENV_SETTINGS, EnvSetting
from samebits.determinism._rules import UNSET, CheckContext, RuleFinding, Rule, register_rule, rule

# --- environment -------------------------------------------------------------------


def _env_rule(setting: EnvSetting) -> Rule:
    def check_env(ctx: CheckContext) -> Iterator[RuleFinding]:
        value = ctx.environ.get(setting.name)
        if setting.name == "OMP_NUM_THREADS" and value is None and _config_pins_threads(ctx):
            return  # the config pins the count (config-num-threads checks it): nothing varies
        if value is None or value in setting.unset_values:
            default = setting.default or _default_threads()
            fix = f"export {setting.name}={default} (samebits.deterministic_mode() sets it when unset)"
            yield RuleFinding(setting.name, UNSET if value is None else value, fix,
                              advice=_unset_advice(setting))
        else:
            problem = setting.validate(value)
            if problem:
                yield RuleFinding(setting.name, value, f"{setting.name} {problem}; {setting.fix}")
    return Rule(id=setting.rule_id, category="env", setting=setting.name, checks=setting.checks,
                why=setting.why, fix=setting.fix, func=check_env, requires=setting.requires)


def _unset_advice(setting: EnvSetting) -> str:
    if setting.name == "OMP_NUM_THREADS":
        threads = _default_threads()
        if threads != "<n>":  # name the count, so the fix pins the one runs here already use
            return setting.unset_advice.replace("its default thread count,",
                                                f"its default thread count ({threads} here),")
    return setting.unset_advice


def _default_threads() -> str:
    """torch's default thread count here, when torch is already imported (importing it for a
    number would cost the CLI seconds); else ``<n>``."""
    torch = sys.modules.get("torch")
    return str(torch.get_num_threads()) if torch is not None else "<n>"


def _config_pins_threads(ctx: CheckContext) -> bool:
    if ctx.config is None:
        return False
    values = [value for key in THREAD_KEYS for _, value in ctx.config.find(key)]
    return bool(values) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values)


for _setting in ENV_SETTINGS:
    register_rule(_env_rule(_setting))

# --- torch flags of the running process -------------------------------------------


@rule("torch-deterministic-algorithms", category="torch",
      setting="torch.use_deterministic_algorithms",
      checks="deterministic algorithms are on, and not in warn-only mode",
      why="Without it, ops such as index_put_(accumulate=True), index_copy_ and CUDA "
          "scatter_add_/index_add_ race (see the op catalog); warn_only lets them run.",
      fix="torch.use_deterministic_algorithms(True) (samebits.deterministic_mode() does it)")
def _deterministic_algorithms(ctx: CheckContext):
    import torch
    if not torch.are_deterministic_algorithms_enabled():
        yield RuleFinding("torch.use_deterministic_algorithms", False)
    elif torch.is_deterministic_algorithms_warn_only_enabled():
        yield RuleFinding("torch.use_deterministic_algorithms", "True (warn_only=True)",
                      "torch.use_deterministic_algorithms(True) without warn_only")


@rule("torch-cudnn-deterministic", category="torch", setting="torch.backends.cudnn.deterministic",
      checks="cuDNN is restricted to deterministic algorithms",
      why="Several cuDNN convolution backward algorithms accumulate with atomics.",
      fix="torch.backends.cudnn.deterministic = True")
def _cudnn_deterministic(ctx: CheckContext):
    import torch
    if not torch.backends.cudnn.deterministic:
        yield RuleFinding("torch.backends.cudnn.deterministic", False)


@rule("torch-cudnn-benchmark", category="torch", setting="torch.backends.cudnn.benchmark",
      checks="cuDNN benchmarking is off",
      why="Benchmarking times candidate algorithms on each run and keeps the fastest, so "
          "the algorithm (and the bits) depend on timing noise.",
      fix="torch.backends.cudnn.benchmark = False")
def _cudnn_benchmark(ctx: CheckContext):
    import torch
    if torch.backends.cudnn.benchmark:
        yield RuleFinding("torch.backends.cudnn.benchmark", True)


@rule("torch-mkldnn-deterministic", category="torch", setting="torch.backends.mkldnn.deterministic",
      checks="oneDNN (mkldnn) is restricted to deterministic algorithms",
      why="The switch asks oneDNN (PyTorch's CPU convolution and matmul backend) for "
          "deterministic algorithms; without it oneDNN may pick kernels that combine "
          "per-thread partial results in scheduling order.",
      fix="torch.backends.mkldnn.deterministic = True")
def _mkldnn_deterministic(ctx: CheckContext):
    import torch
    if hasattr(torch.backends.mkldnn, "deterministic") and not torch.backends.mkldnn.deterministic:
        yield RuleFinding("torch.backends.mkldnn.deterministic", False)


@rule("torch-fill-uninitialized-memory", category="torch",
      setting="torch.utils.deterministic.fill_uninitialized_memory",
      checks="uninitialized memory (torch.empty and friends) is filled",
      why="Code that reads memory it never wrote sees whatever the allocator left there; "
          "filling it (NaN / max int) makes such reads repeatable and visible.",
      fix="torch.utils.deterministic.fill_uninitialized_memory = True")
def _fill_uninitialized(ctx: CheckContext):
    import torch.utils.deterministic
    if not torch.utils.deterministic.fill_uninitialized_memory:
        yield RuleFinding("torch.utils.deterministic.fill_uninitialized_memory", False)


_INDUCTOR_AUTOTUNE = ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise",
                      "coordinate_descent_tuning")


@rule("torch-inductor-autotune", category="torch", setting="torch._inductor.config",
      checks="inductor does not autotune (or runs in its deterministic mode)",
      why="Autotuning benchmarks kernel configs on each run and keeps the fastest; the "
          "configs reduce in different orders, so timing noise picks the bits.",
      fix="leave torch._inductor.config.max_autotune*/coordinate_descent_tuning off, or "
          "turn on torch.use_deterministic_algorithms (it sets inductor's deterministic mode)")
def _inductor_autotune(ctx: CheckContext):
    config = sys.modules.get("torch._inductor.config")
    if config is None:  # not imported yet: it will read these variables when it is
        for name in _INDUCTOR_AUTOTUNE:
            var = f"TORCHINDUCTOR_{name.upper()}"
            if ctx.environ.get(var) == "1":
                yield RuleFinding(var, "1", f"unset {var}")
        return
    if getattr(config, "deterministic", False):
        return
    for name in _INDUCTOR_AUTOTUNE:
        if getattr(config, name, False):
            yield RuleFinding(f"torch._inductor.config.{name}", True)


@rule("torch-num-threads", category="torch", setting="torch.get_num_threads()",
      checks="torch's intra-op thread count equals OMP_NUM_THREADS",
      why="The thread count decides how CPU reductions are split; OMP_NUM_THREADS is what "
          "child processes and the record see, so the two must agree.",
      fix="torch.set_num_threads(int(os.environ['OMP_NUM_THREADS'])), or pass num_threads "
          "to samebits.deterministic_mode()")
def _num_threads(ctx: CheckContext):
    import torch
    pinned = ctx.environ.get("OMP_NUM_THREADS")
    if pinned is None or ENV_BY_NAME["OMP_NUM_THREADS"].validate(pinned):
        return  # env-omp-threads reports it
    if torch.get_num_threads() != int(pinned):
        yield RuleFinding("torch.get_num_threads()", torch.get_num_threads())


@rule("torch-cublas-before-cuda", category="torch", setting="CUBLAS_WORKSPACE_CONFIG",
      checks="CUBLAS_WORKSPACE_CONFIG was valid before CUDA started in this process",
      why="cuBLAS reads the variable when it creates its handle; setting it after CUDA has "
          "started has no effect on handles that already exist.",
      fix="set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the launcher (or before the first CUDA "
          "call) and restart the process")
def _cublas_before_cuda(ctx: CheckContext):
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    value = ctx.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if value is None or ENV_BY_NAME["CUBLAS_WORKSPACE_CONFIG"].validate(value):
        yield RuleFinding("CUBLAS_WORKSPACE_CONFIG", f"{value or UNSET} (CUDA already initialized)")


# --- generic config keys ----------------------------------------------------------

# Overlaps that carry a reduction: their order/bucketing is decided by timing.  Pure
# gathers (overlap_param_gather, tp_comm_overlap_ag, overlap_p2p_comm) only copy bits.
COMM_OVERLAP_KEYS = ("overlap_grad_reduce", "tp_comm_overlap", "tp_comm_overlap_rs",
                     "tp_comm_bulk_dgrad", "tp_comm_bulk_wgrad", "overlap_moe_expert_parallel_comm")
ATOMIC_FUSION_KEYS = ("cross_entropy_loss_fusion", "use_flash_attn")
THREAD_KEYS = ("num_threads", "intra_op_threads", "omp_num_threads", "torch_num_threads")
DETERMINISM_SWITCH_KEYS = ("deterministic", "deterministic_mode", "use_deterministic_algorithms")


def _keys_off(keys: tuple[str, ...]):
    """A config rule's check: every key of ``keys`` set to a true value is a finding."""
    def check(ctx: CheckContext) -> Iterator[RuleFinding]:
        for key in keys:
            for path, value in ctx.config.find(key):
                if value not in (False, None, 0, "false", "False", "0", "no", "off", ""):
                    yield RuleFinding(path, value, f"set {path} = false")
    return check


rule("config-comm-overlap", category="config", setting=", ".join(COMM_OVERLAP_KEYS),
     keys=COMM_OVERLAP_KEYS,
     checks="communication that reduces is not overlapped with compute",
     why="With overlap, timing decides the order and bucketing of reductions: PyTorch DDP "
         "rebuilds its buckets from the order gradients became ready, Megatron launches a "
         "bucket's reduce as soon as its last gradient arrives, and TP overlap "
         "(userbuffers) splits GEMM+reduce-scatter into chunks reduced in arrival order.  "
         "Megatron's deterministic mode requires tp_comm_overlap off.",
     fix="set it to false (or prove it harmless with paired runs and waive this rule "
         "with --ignore config-comm-overlap)")(_keys_off(COMM_OVERLAP_KEYS))

rule("config-atomic-fusion", category="config", setting=", ".join(ATOMIC_FUSION_KEYS),
     keys=ATOMIC_FUSION_KEYS,
     checks="fused kernels known to accumulate with atomics are off",
     why="Megatron's fused cross-entropy is not deterministic (Megatron asserts it off in "
         "deterministic mode); flash-attention's backward accumulates dQ with atomicAdd "
         "unless called with deterministic=True.",
     fix="set it to false")(_keys_off(ATOMIC_FUSION_KEYS))


@rule("config-num-threads", category="config", setting=", ".join(THREAD_KEYS), keys=THREAD_KEYS,
      checks="the CPU thread count is pinned to a positive integer",
      why="CPU reductions give different bits at different thread counts (measured: a 10M "
          "element sum and the mkldnn conv weight gradient differ between 1 and 2 threads); "
          "an unpinned count follows the machine's core count.",
      fix="set it to a positive integer, the same on every run")
def _config_threads(ctx: CheckContext):
    for key in THREAD_KEYS:
        for path, value in ctx.config.find(key):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                yield RuleFinding(path, value, f"set {path} to a positive integer (e.g. 1)")


@rule("config-seed", category="config", setting="seed", keys=("seed",),
      checks="the base seed is a fixed integer",
      why="Without a fixed base seed every run draws different initial weights, data "
          "order and dropout masks.",
      fix="set seed to an integer")
def _config_seed(ctx: CheckContext):
    for path, value in ctx.config.find("seed"):
        if isinstance(value, bool) or not isinstance(value, int):
            yield RuleFinding(path, value, f"set {path} to an integer (e.g. 0)")


@rule("config-deterministic-off", category="config", setting=", ".join(DETERMINISM_SWITCH_KEYS),
      keys=DETERMINISM_SWITCH_KEYS,
      checks="the framework's own deterministic switch is not turned off",
      why="The config explicitly disables the framework's deterministic mode "
          "(torchtitan debug.deterministic, Megatron deterministic_mode).",
      fix="set it to true")
def _deterministic_off(ctx: CheckContext):
    for key in DETERMINISM_SWITCH_KEYS:
        for path, value in ctx.config.find(key):
            if value is False or value in ("false", "False", 0):
                yield RuleFinding(path, value, f"set {path} = true")
