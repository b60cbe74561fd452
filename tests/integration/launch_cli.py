"""Runs `python launch.py ARGS` as a user would (imported by the integration tests: a module of its own,
since tests/integration/conftest.py shadows the name `conftest`)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_launch(args, cwd, env_extra=None, timeout=600):
    """Run `python launch.py ARGS` in `cwd` (outputs and mlruns land there); returns CompletedProcess."""
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )
