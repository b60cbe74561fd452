"""The run record: everything needed to reproduce a run, written to its output dir.

Files: resolved.yaml (the fully resolved config), overrides.yaml (the command-line overrides),
git.json (SHA, branch, dirty flag) + git.diff (uncommitted changes), env.json (package versions,
Python, platform, CPU count). Hydra's own .hydra/ folder sits beside them.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

# The code's own checkout, whatever the working directory of the run is.
CODE_ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("miles", "torch", "ray", "mlflow", "hydra-core", "omegaconf", "safetensors", "tokenizers", "numpy")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], cwd=CODE_ROOT, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout


def git_info() -> tuple[dict, str]:
    sha = _git("rev-parse", "HEAD")
    diff = _git("diff", "HEAD") or ""
    status = _git("status", "--porcelain") or ""
    info = {
        "sha": sha.strip() if sha else None,
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
    }


def write_run_record(run_dir: str | Path, resolved_yaml: str, overrides: list[str]) -> tuple[dict[str, Path], dict]:
    """Write the record files; returns (name -> path, for the MLflow artifacts; the git info)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    git, diff = git_info()
    files = {
        "resolved.yaml": resolved_yaml,
        "overrides.yaml": "".join(f"- {o}\n" for o in overrides) or "[]\n",
        "git.json": json.dumps(git, indent=2) + "\n",
        "git.diff": diff,
        "env.json": json.dumps(env_info(), indent=2) + "\n",
    }
    paths = {}
    for name, text in files.items():
        path = run_dir / name
        path.write_text(text)
        paths[name] = path
    return paths, git
