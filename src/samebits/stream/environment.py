"""The environment fingerprint written into every stream header: what can change a run's bits
(library versions, device, threads, determinism variables) or explain a difference (host).
"""

from __future__ import annotations

import os
import platform
import socket
import sys

import numpy
import torch

# Variables that decide (or explain) run-to-run bits.  Prefix entries end with "_".
_ENV_PREFIXES = ("NCCL_", "NVTE_", "SAMEBITS_", "TORCH_", "CUDA_", "CUBLAS_", "CUDNN_", "TRITON_")
_ENV_NAMES = ("PYTHONHASHSEED", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
              "FLASH_ATTENTION_DETERMINISTIC", "MAMBA_DETERMINISTIC", "CAUSAL_CONV1D_DETERMINISTIC", "KMP_AFFINITY",
              "OMP_PROC_BIND")


def environment_fingerprint() -> dict:
    env: dict = {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cuda": torch.version.cuda,
        "env": {key: value for key, value in sorted(os.environ.items())
                if key in _ENV_NAMES or key.startswith(_ENV_PREFIXES)},
        "numpy": numpy.__version__,  # a dependency (the stream encoder imports it too)
    }
    if torch.cuda.is_available():
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # NCCL may be absent from the build
            env["nccl"] = None
        env["device"] = torch.cuda.get_device_name()
        env["device_count"] = torch.cuda.device_count()
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        env["cudnn_deterministic"] = torch.backends.cudnn.deterministic
        env["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    else:
        env["device"] = platform.processor() or platform.machine()
    return env
