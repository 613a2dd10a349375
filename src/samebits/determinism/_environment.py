"""Environment variables that decide run-to-run bits: accepted values, defaults, reasons.

One table, used by `deterministic_mode` (fills unset variables, refuses bad ones the user set,
never overwrites) and by the `env-*` rules of `samebits check`.  An unset PYTHONHASHSEED or
OMP_NUM_THREADS cannot change this machine's bits by itself: `EnvSetting.unset_advice` says
when it would, printed as advice, not a violation.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

CUBLAS_WORKSPACE_CONFIGS = (":4096:8", ":16:8")
# Algorithms whose reduction order the topology fixes (a ring, CollNet's fixed trees); Tree's
# shape follows the tuner and node count, NVLS reduces in arrival order, PAT's order changes with scale.
NCCL_ALGOS_DETERMINISTIC = ("Ring", "CollnetDirect", "CollnetChain")
NCCL_ALGOS_REJECTED = ("Tree", "NVLS", "NVLSTree", "PAT")
NCCL_PROTOS = ("Simple", "LL", "LL128")


@dataclass(frozen=True)
class EnvSetting:
    """One environment variable: the rule that checks it and what deterministic_mode sets."""

    name: str
    rule_id: str
    default: str
    validate: Callable[[str], str | None]  # returns a problem sentence, or None if fine
    checks: str
    why: str
    fix: str
    requires: tuple[str, ...] = ()  # software the variable matters for (see _rules.FEATURES)
    unset_advice: str = ""
    """Non-empty: unset (or PYTHONHASHSEED=random) is advice, not a violation; the sentence
    says the only cases in which the unset value changes the bits."""
    unset_values: tuple[str, ...] = ()  # values that mean the same as unset


def _one_of(allowed: tuple[str, ...]) -> Callable[[str], str | None]:
    def validate(value: str) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"
    return validate


def _starts_with_1(value: str) -> str | None:
    return None if value.startswith("1") else "must be 1"


def _is_0(value: str) -> str | None:
    return None if value.strip() == "0" else "must be 0"


def _int_within(value: str, low: int, high: float = float("inf")) -> bool:
    try:
        return low <= int(value) <= high
    except ValueError:
        return False


def _positive_int(value: str) -> str | None:
    return None if _int_within(value, 1) else "must be a single positive integer"


def _hash_seed(value: str) -> str | None:
    return None if _int_within(value, 0, 4294967295) else "must be an integer in [0, 4294967295] (not 'random')"


def _pinned_tokens(allowed: tuple[str, ...], rejected: tuple[str, ...], what: str):
    lower = {a.lower(): a for a in allowed}

    def validate(value: str) -> str | None:
        # NCCL syntax: "Ring", "^NVLS" (exclude), or per collective "allreduce:ring;...".
        for segment in filter(None, (s.strip() for s in value.split(";"))):
            tokens = [t.strip() for t in segment.split(":", 1)[-1].split(",") if t.strip()]
            if any(t.startswith("^") for t in tokens):
                return (f"'^' excludes {what}s but leaves NCCL's tuner to choose among the "
                        f"rest; pin one of {', '.join(allowed)}")
            if len(tokens) != 1:
                return f"pin exactly one {what} per collective, one of {', '.join(allowed)}"
            token = tokens[0]
            if token.lower() not in lower:
                reason = ("reduces in an order that varies" if token.lower() in
                          {r.lower() for r in rejected} else "is not a known NCCL " + what)
                return f"{token} {reason}; use one of {', '.join(allowed)}"
        return None
    return validate


ENV_SETTINGS: tuple[EnvSetting, ...] = (
    EnvSetting(
        name="CUBLAS_WORKSPACE_CONFIG", requires=("cuda", "gpu"), rule_id="env-cublas-workspace", default=":4096:8",
        validate=_one_of(CUBLAS_WORKSPACE_CONFIGS),
        checks="CUBLAS_WORKSPACE_CONFIG is :4096:8 or :16:8",
        why="cuBLAS picks split-K reductions whose order depends on which workspace a stream "
            "gets; a fixed workspace size makes GEMMs repeatable.  cuBLAS reads the variable "
            "when its handle is created, so it must be set before the first CUDA call.",
        fix="export CUBLAS_WORKSPACE_CONFIG=:4096:8 before the process starts CUDA"),
    EnvSetting(
        name="NCCL_ALGO", requires=("nccl", "gpu"), rule_id="env-nccl-algo", default="Ring",
        validate=_pinned_tokens(NCCL_ALGOS_DETERMINISTIC, NCCL_ALGOS_REJECTED, "algorithm"),
        checks="NCCL_ALGO pins one algorithm whose reduction order is fixed "
               f"({', '.join(NCCL_ALGOS_DETERMINISTIC)})",
        why="Left alone, NCCL's tuner picks the algorithm per message size and topology; Tree "
            "and NVLS (in-switch reduction) sum in an order that varies.  Note: Ring pins the "
            "algorithm, not the physical ring, so a different node allocation can still "
            "change the bits (Megatron names the same gap).",
        fix="export NCCL_ALGO=Ring"),
    EnvSetting(
        name="NCCL_PROTO", requires=("nccl", "gpu"), rule_id="env-nccl-proto", default="Simple",
        validate=_pinned_tokens(NCCL_PROTOS, (), "protocol"),
        checks="NCCL_PROTO pins one protocol (Simple, LL or LL128)",
        why="The protocol sets the chunk size, and the chunking decides at which rank each "
            "element's ring reduction starts; the tuner's choice varies with message size, "
            "NCCL version and tuner plugins.",
        fix="export NCCL_PROTO=Simple"),
    EnvSetting(
        name="NVTE_ALLOW_NONDETERMINISTIC_ALGO", requires=("cuda", "gpu", "transformer_engine"),
        rule_id="env-nvte-nondeterministic",
        default="0", validate=_is_0,
        checks="NVTE_ALLOW_NONDETERMINISTIC_ALGO is 0",
        why="Transformer Engine otherwise picks fused-attention backward kernels that "
            "accumulate with atomics.",
        fix="export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"),
    EnvSetting(
        name="FLASH_ATTENTION_DETERMINISTIC", requires=("cuda", "gpu", "flash_attn"), rule_id="env-flash-attention",
        default="1",
        validate=_starts_with_1,
        checks="FLASH_ATTENTION_DETERMINISTIC is 1",
        why="flash-attention's backward accumulates dQ with atomicAdd unless called with "
            "deterministic=True; libraries such as HF transformers read this variable to "
            "pass it.",
        fix="export FLASH_ATTENTION_DETERMINISTIC=1"),
    EnvSetting(
        name="MAMBA_DETERMINISTIC", requires=("cuda", "gpu", "mamba_ssm"), rule_id="env-mamba", default="1",
        validate=_starts_with_1,
        checks="MAMBA_DETERMINISTIC is 1",
        why="mamba-ssm's backward kernels use atomics unless this is set (Megatron requires it).",
        fix="export MAMBA_DETERMINISTIC=1"),
    EnvSetting(
        name="CAUSAL_CONV1D_DETERMINISTIC", requires=("cuda", "gpu", "causal_conv1d"), rule_id="env-causal-conv1d",
        default="1",
        validate=_starts_with_1,
        checks="CAUSAL_CONV1D_DETERMINISTIC is 1",
        why="causal-conv1d's weight-gradient kernel uses atomics unless this is set "
            "(Megatron requires it).",
        fix="export CAUSAL_CONV1D_DETERMINISTIC=1"),
    EnvSetting(
        name="PYTHONHASHSEED", rule_id="env-pythonhashseed", default="0",
        validate=_hash_seed,
        checks="PYTHONHASHSEED is a fixed integer",
        why="A randomized str hash changes set iteration order, so code that builds "
            "parameter groups, buckets or data orders from a set changes between runs.  "
            "It only takes effect in new interpreters: set it in the launcher.",
        fix="launch with PYTHONHASHSEED=0 (e.g. PYTHONHASHSEED=0 torchrun ...)",
        # Python refuses to start with any other value, so a bad value is a violation.
        unset_values=("random",),
        unset_advice="str and bytes hashes differ on every run, which changes the bits only if "
                     "the program lets the iteration order of a set (or frozenset) of strings "
                     "decide something: parameter groups, gradient buckets, a data order "
                     "(dict order is insertion order and does not depend on it)"),
    EnvSetting(
        # default: deterministic_mode fills in the pinned thread count
        name="OMP_NUM_THREADS", rule_id="env-omp-threads", default="",
        validate=_positive_int,
        checks="OMP_NUM_THREADS pins the CPU thread count",
        why="CPU reductions split work by thread: the same sum gives different bits at 1 "
            "and 2 threads (measured), and torch's default is the machine's core count.",
        fix="export OMP_NUM_THREADS=<n> (the same n on every run)",
        unset_advice="torch uses its default thread count, the same on every run on this "
                     "machine, so runs here agree; the bits change only if the count differs "
                     "between runs: another machine with another core count, another CPU "
                     "affinity (taskset, a container's CPU limit), or a launcher that sets it "
                     "for some runs (torchrun sets OMP_NUM_THREADS=1 when it starts more than one "
                     "process per node)"),
)

ENV_BY_NAME = {s.name: s for s in ENV_SETTINGS}


def interpreter_hash_randomized() -> bool:
    """True when this interpreter's str hashes are randomized, from its start-up environment
    (os.environ may have been changed since)."""
    if not sys.flags.hash_randomization:
        return False  # PYTHONHASHSEED=0 at start-up
    start_value = startup_environ().get("PYTHONHASHSEED")
    return _hash_seed(start_value) is not None if start_value is not None else True


def startup_environ() -> dict[str, str]:
    """The environment this process was started with (Linux /proc), else os.environ."""
    try:
        with open(f"/proc/{os.getpid()}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return dict(os.environ)
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
