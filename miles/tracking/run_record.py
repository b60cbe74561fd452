"""The run record: everything needed to reproduce a run, written to its output dir.

Files: resolved.yaml (the fully resolved config), overrides.yaml (the command-line overrides,
what `+reproduce` replays), git.json (SHA, branch, dirty flag) + git.diff (uncommitted changes),
env.json (package versions, Python, platform, the driver's hardware), run.json (seed, deterministic
mode, the command line, the run it reproduces). Hydra's own .hydra/ folder sits beside them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import yaml

# The code's own checkout, whatever the working directory of the run is.
CODE_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("miles", "torch", "ray", "mlflow", "mlflow-skinny", "hydra-core", "omegaconf", "hydra-optuna-sweeper",
            "optuna", "safetensors", "tokenizers", "numpy", "transformers", "triton", "flash-attn", "vllm", "sglang",
            "megatron-core")
REPRODUCE_OF_ENV = "MILES_REPRODUCE_OF"  # set by miles.tracking.reproduce for the run it starts


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=CODE_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_sha() -> str | None:
    return (_git("rev-parse", "HEAD") or "").strip() or None


def git_info() -> tuple[dict, str]:
    sha = git_sha()
    diff = _git("diff", "HEAD") or ""
    status = _git("status", "--porcelain") or ""
    info = {
        "sha": sha,
        "branch": (_git("rev-parse", "--abbrev-ref", "HEAD") or "").strip() or None,
        "dirty": bool(status.strip()),
    }
    return info, diff


def env_info() -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "packages": versions,
        "hardware": hardware_info(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_info() -> dict:
    """The driver's machine: CPU, RAM and the GPUs torch sees (actors on other nodes may differ)."""
    import torch

    info: dict = {
        "cpu": _cpu_model(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            info["gpus"].append({
                "name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                "capability": f"{props.major}.{props.minor}",
            })
        info["cudnn"] = torch.backends.cudnn.version()
        info["driver"] = _nvidia_driver()
    return info


def _nvidia_driver() -> str | None:
    """The NVIDIA driver version (torch reports only the CUDA runtime it was built with)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def write_run_record(run_dir: str | Path, resolved_yaml: str, overrides: list[str], seed: int,
                     deterministic: bool) -> tuple[dict[str, Path], dict]:
    """Write the record files; returns (name -> path, for the MLflow artifacts; the git info)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    git, diff = git_info()
    run = {
        "seed": seed,
        "deterministic": deterministic,
        "argv": sys.argv,
        "reproduce_of": os.environ.get(REPRODUCE_OF_ENV),
    }
    files = {
        "resolved.yaml": resolved_yaml,
        "overrides.yaml": yaml.safe_dump(list(overrides), default_flow_style=False),
        "git.json": json.dumps(git, indent=2) + "\n",
        "git.diff": diff,
        "env.json": json.dumps(env_info(), indent=2) + "\n",
        "run.json": json.dumps(run, indent=2) + "\n",
    }
    paths = {}
    for name, text in files.items():
        path = run_dir / name
        path.write_text(text)
        paths[name] = path
    return paths, git
