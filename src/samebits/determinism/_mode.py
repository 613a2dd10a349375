"""`deterministic_mode`: set, validate and record everything that decides run-to-run bits.
Every violation is found and raised before anything changes; restoring undoes flags,
environment and thread count in reverse order (docs/determinism.md, "`deterministic_mode`").
"""

from __future__ import annotations

import copy
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from samebits.determinism._environment import (
    ENV_BY_NAME,
    ENV_SETTINGS,
    interpreter_hash_randomized,
)
from samebits.determinism._rules import UNSET, Violation, run_checks, violation_error
from samebits.determinism._seeds import SEED_PURPOSES, SEED_RULE_VERSION, check_coordinates, derive_seed, seed_all
from samebits.errors import ConfigError

RECORD_SCHEMA = "samebits.determinism/1"

_ACTIVE: list["DeterministicMode"] = []


def active_record() -> dict | None:
    """A copy of the innermost active deterministic-mode record, or None when none is active."""
    return copy.deepcopy(_ACTIVE[-1].record) if _ACTIVE else None


@dataclass
class _Flag:
    """A process-wide torch setting: how to read it, write it, and the value we want."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    target: Any


def _attr_flag(name: str, obj: Any, attr: str, target: Any) -> _Flag:
    return _Flag(name, lambda: getattr(obj, attr), lambda v: setattr(obj, attr, v), target)


def _torch_flags(allow_tf32: bool, allow_reduced_precision_reduction: bool) -> list[_Flag]:
    """The torch flags in apply order (restored in reverse)."""
    import torch
    import torch._inductor.config as inductor  # torch.use_deterministic_algorithms imports it too
    import torch.utils.deterministic

    backends = torch.backends
    flags: list[_Flag] = []
    # Inductor first: use_deterministic_algorithms() also writes inductor.deterministic, so
    # restoring in reverse order puts the user's own inductor value back last.
    flags.append(_attr_flag("inductor.deterministic", inductor, "deterministic", True))
    for name in ("max_autotune", "max_autotune_gemm", "max_autotune_pointwise",
                 "coordinate_descent_tuning"):
        if hasattr(inductor, name):
            flags.append(_attr_flag(f"inductor.{name}", inductor, name, False))

    def set_deterministic(value):
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])

    flags.append(_Flag("deterministic_algorithms",
                       lambda: [torch.are_deterministic_algorithms_enabled(),
                                torch.is_deterministic_algorithms_warn_only_enabled()],
                       set_deterministic, [True, False]))
    flags.append(_attr_flag("cudnn.deterministic", backends.cudnn, "deterministic", True))
    flags.append(_attr_flag("cudnn.benchmark", backends.cudnn, "benchmark", False))
    if hasattr(backends.mkldnn, "deterministic"):
        flags.append(_attr_flag("mkldnn.deterministic", backends.mkldnn, "deterministic", True))
    flags.append(_attr_flag("fill_uninitialized_memory", torch.utils.deterministic,
                            "fill_uninitialized_memory", True))

    # TF32: torch >= 2.9 has per-backend fp32_precision; mixing it with the legacy
    # allow_tf32 getters raises, so use one API.  Leaves first, then the matmul precision
    # (which rewrites the matmul leaves), so that restoring puts the exact leaves back.
    tf32 = "tf32" if allow_tf32 else "ieee"
    if hasattr(backends, "fp32_precision"):
        for label, obj, target in (("cuda.matmul", backends.cuda.matmul, tf32),
                                   ("cudnn.conv", backends.cudnn.conv, tf32),
                                   ("cudnn.rnn", backends.cudnn.rnn, tf32),
                                   ("mkldnn.matmul", backends.mkldnn.matmul, "ieee"),
                                   ("mkldnn.conv", backends.mkldnn.conv, "ieee"),
                                   ("mkldnn.rnn", backends.mkldnn.rnn, "ieee")):
            flags.append(_attr_flag(f"{label}.fp32_precision", obj, "fp32_precision", target))
    else:  # pragma: no cover - torch < 2.9
        flags.append(_attr_flag("cuda.matmul.allow_tf32", backends.cuda.matmul, "allow_tf32",
                                allow_tf32))
        flags.append(_attr_flag("cudnn.allow_tf32", backends.cudnn, "allow_tf32", allow_tf32))
    flags.append(_Flag("float32_matmul_precision", torch.get_float32_matmul_precision,
                       torch.set_float32_matmul_precision,
                       "high" if allow_tf32 else "highest"))

    # Reduced-precision reductions inside fp16/bf16 GEMMs (cuBLAS split-K in half precision).
    matmul = backends.cuda.matmul
    for kind in ("fp16", "bf16"):
        name = f"allow_{kind}_reduced_precision_reduction"
        flags.append(_reduction_flag(f"cuda.matmul.{name}", matmul, name,
                                     allow_reduced_precision_reduction))
    try:
        matmul.allow_fp16_accumulation
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch
        pass
    else:
        flags.append(_attr_flag("cuda.matmul.allow_fp16_accumulation", matmul,
                                "allow_fp16_accumulation", allow_reduced_precision_reduction))
    if hasattr(backends.cuda, "allow_fp16_bf16_reduction_math_sdp"):
        flags.append(_Flag("cuda.fp16_bf16_reduction_math_sdp",
                           backends.cuda.fp16_bf16_reduction_math_sdp_allowed,
                           backends.cuda.allow_fp16_bf16_reduction_math_sdp,
                           allow_reduced_precision_reduction))
    return flags


def _reduction_flag(label: str, matmul: Any, name: str, target: bool) -> _Flag:
    """cuBLAS reduced-precision flags carry a second 'split-K allowed' bool in torch >= 2.9."""
    def get():
        try:
            return [getattr(matmul, name), getattr(matmul, name + "_split_k")]
        except AttributeError:  # pragma: no cover - older torch
            return getattr(matmul, name)

    def set_(value):
        setattr(matmul, name, tuple(value) if isinstance(value, list) else value)

    return _Flag(label, get, set_, target)


class DeterministicMode:
    """What `deterministic_mode()` returns, settings applied: its JSON-ready `record`, and a context
    manager (or `restore()`) that puts back the previous flags, environment and thread count."""

    def __init__(self, record: dict, undo: list[Callable[[], None]]):
        self.record = record
        self._undo = undo
        self.active = True

    def restore(self) -> None:
        """Undo everything this mode changed (idempotent).  Modes nest: restore inner first."""
        if not self.active:
            return
        if _ACTIVE and _ACTIVE[-1] is not self:
            raise RuntimeError("deterministic modes must be restored innermost first; "
                               "restore the mode entered after this one before this one")
        for undo in reversed(self._undo):
            undo()
        self.active = False
        _ACTIVE.pop()

    def __enter__(self) -> "DeterministicMode":
        return self

    def __exit__(self, *exc_info) -> None:
        self.restore()

    def __repr__(self) -> str:
        state = "active" if self.active else "restored"
        seeds = self.record["seeds"]
        return f"<DeterministicMode {state} seed={seeds['base'] if seeds else None}>"


def deterministic_mode(*, seed: int | None = 0, num_threads: int | None = None,
                       coordinates: Mapping[str, int] | None = None,
                       allow_tf32: bool = False, allow_reduced_precision_reduction: bool = False,
                       nccl_algo: str | None = None, nccl_proto: str | None = None,
                       cublas_workspace_config: str | None = None,
                       expect_child_processes: bool = False,
                       config: Mapping | None = None) -> DeterministicMode:
    """Make this process bitwise deterministic, fail closed, and record what decides the bits.

    A plain call (settings stay until `restore()`) or a context manager; docs/determinism.md,
    "`deterministic_mode`", has each argument.  ``seed``: the global RNGs get the ``init``
    seed, ``record["seeds"]["derived"]`` this rank's others (None leaves the RNGs alone).
    ``num_threads`` None pins OMP_NUM_THREADS if set, else torch's current count.
    Raises `DeterminismError` listing every violation before changing anything.
    """
    import torch

    wanted = _wanted_env(nccl_algo, nccl_proto, cublas_workspace_config)
    if num_threads is not None and (not _is_int(num_threads) or num_threads < 1):
        raise ConfigError(f"num_threads must be a positive int or None, got {num_threads!r}")
    if seed is not None and not _is_int(seed):
        raise ConfigError(f"seed must be an int or None, got {seed!r}")
    coordinates = check_coordinates(coordinates)  # before anything is changed
    derived = {p: derive_seed(seed, purpose=p, coordinates=coordinates) for p in SEED_PURPOSES} \
        if seed is not None else {}

    violations: list[Violation] = []
    threads, thread_source = _plan_threads(num_threads, violations)
    wanted["OMP_NUM_THREADS"] = str(threads)
    env_to_set = _plan_env(wanted, violations)
    cuda_initialized, hash_randomized = _process_violations(env_to_set, expect_child_processes, violations)
    config_rules: list[str] | None = None
    if config is not None:
        result = run_checks(config, env=False, torch_flags=False)
        violations.extend(result.violations)
        config_rules = result.rules_run
    if violations:
        raise violation_error(violations, "samebits.deterministic_mode")

    # Nothing below can fail on user input: apply, remembering how to undo.
    flags = _torch_flags(allow_tf32, allow_reduced_precision_reduction)
    undo = _apply(env_to_set, threads, flags)
    if seed is not None:
        seed_all(derived["init"])
    seeds = None if seed is None else {"rule": SEED_RULE_VERSION, "base": seed, "coordinates": coordinates,
                                       "global": derived["init"], "global_purpose": "init", "derived": derived}
    record = {
        "schema": RECORD_SCHEMA, "versions": _versions(),
        "env": {s.name: os.environ.get(s.name) for s in ENV_SETTINGS}, "env_set_by_samebits": sorted(env_to_set),
        "torch": {flag.name: flag.get() for flag in flags},
        "threads": {"num_threads": threads, "num_interop_threads": torch.get_num_interop_threads(),
                    "source": thread_source},
        "seeds": seeds, "cuda": {"available": torch.cuda.is_available(), "initialized": cuda_initialized},
        "python_hash": {"randomized": hash_randomized, "expect_child_processes": expect_child_processes},
        "config_rules": config_rules, "notes": _notes(hash_randomized, threads, thread_source),
    }
    mode = DeterministicMode(record, undo)
    _ACTIVE.append(mode)
    return mode


def _process_violations(env_to_set: dict[str, str], expect_child_processes: bool,
                        violations: list[Violation]) -> tuple[bool, bool]:
    """Appends what this process did that no setting can undo (CUDA started before cuBLAS's
    variable, a random str hash with child processes); returns (CUDA up, hash random)."""
    import torch

    cuda_initialized = torch.cuda.is_initialized()
    if cuda_initialized and "CUBLAS_WORKSPACE_CONFIG" in env_to_set:
        violations.append(Violation(
            rule="torch-cublas-before-cuda", setting="CUBLAS_WORKSPACE_CONFIG",
            found=f"{UNSET} (CUDA already initialized)",
            fix="set CUBLAS_WORKSPACE_CONFIG=:4096:8 in the launcher (or before the first CUDA "
                "call) and restart the process: cuBLAS reads it only when its handle is created",
            why="cuBLAS reads the variable when it creates its handle"))
    hash_randomized = interpreter_hash_randomized()
    if hash_randomized and expect_child_processes:
        violations.append(Violation(
            rule="env-pythonhashseed", setting="PYTHONHASHSEED",
            found="randomized in this interpreter",
            fix="launch with PYTHONHASHSEED=0 (e.g. PYTHONHASHSEED=0 torchrun ...); setting it "
                "now only reaches spawned children, forked ones keep this random hash secret",
            why=ENV_BY_NAME["PYTHONHASHSEED"].why))
    return cuda_initialized, hash_randomized


def _apply(env_to_set: dict[str, str], threads: int, flags: list[_Flag]) -> list[Callable[[], None]]:
    """Set the environment, thread count and torch flags; returns how to undo each, in order."""
    import torch

    undo: list[Callable[[], None]] = []
    for name, value in env_to_set.items():
        os.environ[name] = value
        undo.append(lambda name=name: os.environ.pop(name, None))
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    undo.append(lambda: torch.set_num_threads(previous_threads))
    for flag in flags:
        previous = flag.get()
        flag.set(flag.target)
        undo.append(lambda flag=flag, previous=previous: flag.set(previous))
    return undo


def _notes(hash_randomized: bool, threads: int, thread_source: str) -> list[str]:
    """The record's notes: what may still differ between machines or runs."""
    notes = []
    if hash_randomized:
        notes.append("this interpreter's str hash is randomized (PYTHONHASHSEED was not fixed at "
                     "start-up): set iteration order can differ between runs of this process")
    if thread_source == "torch default":
        notes.append(f"thread count {threads} comes from this machine's core count; pass "
                     "num_threads= to pin the same count on every machine")
    return notes


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _wanted_env(nccl_algo: str | None, nccl_proto: str | None,
                cublas_workspace_config: str | None) -> dict[str, str | None]:
    """The value deterministic_mode sets for each variable; None where only defaults apply."""
    asked = {"NCCL_ALGO": nccl_algo, "NCCL_PROTO": nccl_proto,
             "CUBLAS_WORKSPACE_CONFIG": cublas_workspace_config}
    for name, value in asked.items():
        if value is not None:
            problem = ENV_BY_NAME[name].validate(value)
            if problem:
                raise ConfigError(f"{name.lower()}={value!r}: {name} {problem}")
    return asked


def _plan_threads(num_threads: int | None, violations: list[Violation]) -> tuple[int, str]:
    import torch

    setting = ENV_BY_NAME["OMP_NUM_THREADS"]
    current = os.environ.get("OMP_NUM_THREADS")
    if current is not None and setting.validate(current):
        violations.append(Violation(setting.rule_id, "OMP_NUM_THREADS", current,
                                    f"OMP_NUM_THREADS {setting.validate(current)}; {setting.fix}",
                                    setting.why))
        current = None
    if num_threads is not None:
        if current is not None and int(current) != num_threads:
            violations.append(Violation(
                setting.rule_id, "OMP_NUM_THREADS", current,
                f"OMP_NUM_THREADS={current} disagrees with num_threads={num_threads}: "
                "unset it or make them equal", setting.why))
        return num_threads, "argument"
    if current is not None:
        return int(current), "OMP_NUM_THREADS"
    return torch.get_num_threads(), "torch default"


def _plan_env(wanted: dict[str, str | None], violations: list[Violation]) -> dict[str, str]:
    """Check each variable; return the ones to set.  Bad user values become violations."""
    to_set: dict[str, str] = {}
    for setting in ENV_SETTINGS:
        if setting.name == "OMP_NUM_THREADS" and setting.name in os.environ:
            continue  # _plan_threads judged it
        current = os.environ.get(setting.name)
        asked = wanted.get(setting.name)
        if current is None:
            to_set[setting.name] = asked or setting.default
            continue
        problem = setting.validate(current)
        if problem:
            violations.append(Violation(setting.rule_id, setting.name, current,
                                        f"{setting.name} {problem}; {setting.fix}", setting.why))
        elif asked is not None and current != asked:
            violations.append(Violation(
                setting.rule_id, setting.name, current,
                f"{setting.name}={current} is set but {asked!r} was asked for: unset it or pass "
                "the same value", setting.why))
    return to_set


def _versions() -> dict:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                "numpy": getattr(sys.modules.get("numpy"), "__version__", None),
                "cpu_capability": None, "platform": platform.platform()}
    try:
        # The SIMD level decides which CPU kernels run, and kernels differ in summation order.
        versions["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # pragma: no cover - older torch
        pass
    return versions
