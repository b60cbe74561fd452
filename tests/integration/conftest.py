"""Fixtures of the integration tier."""

import os
import signal

import pytest
from launch_cli import MLFLOW_SERVER_ENV


@pytest.fixture(scope="session")
def teacher(tmp_path_factory, compose):
    """An OPD teacher for short runs: the built-in teacher recipe (the warm-start SFT, continued) cut
    to 40 steps from the same seeded init as the test students, so far from them and from uniform."""
    from miles.orchestrate.checkpoints import warm_start_checkpoint

    cfg = compose(["task.eval_size=8", "warm_start.steps=40", "warm_start.check_interval=40",
                   "warm_start.target_accuracy=1.0", f"warm_start.cache_dir={tmp_path_factory.mktemp('teacher')}"])
    return warm_start_checkpoint(cfg, log=lambda *_: None)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on a free local port (SQLite store); yields its URI."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],  # the default 4 took ~17 s of CPU to start here, 1 ~7 s (the tests send one request at a time)
        env=MLFLOW_SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("the MLflow server did not start")
            time.sleep(0.5)
    yield uri
    os.killpg(proc.pid, signal.SIGTERM)  # the server and the uvicorn worker it started
    proc.wait(timeout=30)
