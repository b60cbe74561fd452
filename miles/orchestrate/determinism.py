"""Deterministic mode (`deterministic=true`): the same config gives the same numbers, run after run.

Seeds Python, NumPy and torch (every device), makes torch choose deterministic kernels (and raise on
an op that has none instead of silently differing), turns cuDNN autotuning off, and gives cuBLAS a
fixed workspace so its reductions repeat. The settings are per process: the driver calls `enable`,
and the Ray actors get them through the job's runtime_env (`ray_runtime_env`), in place before any
actor imports torch or touches CUDA.
"""

from __future__ import annotations

import os
import random

SEED_ENV = "MILES_DETERMINISTIC_SEED"
# cuBLAS picks reduction splits per call unless its workspace is fixed (CUDA docs, "Results
# reproducibility"); torch refuses deterministic cuBLAS GEMMs without this variable.
CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def enable(seed: int) -> None:
    """Deterministic kernels and seeded RNGs in this process."""
    import numpy as np
    import torch

    os.environ.update(CUBLAS_ENV)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device, CUDA included
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def ray_runtime_env(seed: int) -> dict:
    """A Ray job runtime_env that runs `enable(seed)` in every worker process as it starts."""
    return {
        "env_vars": {**CUBLAS_ENV, SEED_ENV: str(seed)},
        "worker_process_setup_hook": f"{__name__}.setup_ray_worker",
    }


def setup_ray_worker() -> None:
    enable(int(os.environ[SEED_ENV]))
