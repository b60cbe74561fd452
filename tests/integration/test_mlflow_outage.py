"""An MLflow server that goes away mid-run never stops training: the run finishes, and once the
server is back (same backend store) every metric of every step is in it."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from runs import TINY, LiveRun, journal_metrics

pytestmark = pytest.mark.slow


class MlflowServer:
    """`mlflow server` on a fixed port and store, in its own process group (it forks workers)."""

    def __init__(self, root: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.root, self.proc = root, None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        mlflow_bin = Path(sys.executable).parent / "mlflow"
        self.proc = subprocess.Popen(
            [str(mlflow_bin), "server", "--backend-store-uri", f"sqlite:///{self.root}/mlflow.db",
             "--default-artifact-root", str(self.root / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2)
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.fail("the MLflow server did not start")
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.proc = None


@pytest.fixture
def server(tmp_path):
    srv = MlflowServer(tmp_path / "mlflow")
    srv.start()
    yield srv
    srv.stop()


def test_server_stopped_mid_run_loses_no_metric(tmp_path, server):
    live = LiveRun([*TINY, "ray.enabled=false", "steps=12", f"tracking.uri={server.uri}", "tracking.experiment=outage",
                    "tracking.flush_timeout_s=300"], cwd=tmp_path)
    live.wait_for("step    2/12")
    server.stop()
    live.wait_for("MLflow unreachable")
    server.start()  # same port, same backend store
    assert live.finish() == 0, live.output[-3000:]
    assert "MLflow reachable again" in live.output

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.uri)
    (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    assert run.info.status == "FINISHED"
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    logged = journal_metrics(run_dir)
    assert sorted(logged) == list(range(13))
    keys = {k for metrics in logged.values() for k in metrics}
    for key in keys:  # every value of every step made it to the server
        history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert history == {s: m[key] for s, m in logged.items() if key in m}, key
