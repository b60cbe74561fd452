"""Runs `python launch.py ARGS` as a user would (imported by the integration tests: a module of its own,
since tests/integration/conftest.py shadows the name `conftest`)."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The environment of the tests' `mlflow server` processes (tracking only): without MLflow's job execution,
# on by default since MLflow 3.x, which serves GenAI jobs, not runs, metrics or artifacts: a job runner
# and 9 huey consumers, each importing mlflow (measured: a server up in 48 s with them, 17 s without, on
# 2 busy cores), polling for as long as the server lives.
MLFLOW_SERVER_ENV = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def run_launch(args, cwd, env_extra=None, timeout=600):
    """Run `python launch.py ARGS` in `cwd` (outputs and mlruns land there); returns CompletedProcess."""
    import subprocess

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
    )
