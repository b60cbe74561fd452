"""An MLflow server that goes away mid-run never stops training: the run finishes, and once the
server is back (same backend store) every metric of every step is in it. A server that never
answers, or no MLflow at all, costs one warning and no traceback; a SQLite store keeps its
artifacts beside the database, not in the working directory."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from launch_cli import MLFLOW_SERVER_ENV, ROOT, run_launch
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
            env=MLFLOW_SERVER_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
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


SHORT = [*TINY, "ray.enabled=false", "steps=2", "tracking.flush_timeout_s=1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_nobody_runs_costs_one_warning_and_no_traceback(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = run_launch([*SHORT, f"tracking.uri={uri}"], cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    assert output.count(f"MLflow unreachable at {uri} ([Errno 111] Connection refused)") == 1
    assert "Upload them later with:\n  python -m miles.tracking.journal" in output
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert sorted(journal_metrics(run_dir)) == [0, 1, 2]
    assert os.listdir(tmp_path) == ["outputs"]


def test_without_mlflow_a_run_logs_to_its_journal_only(tmp_path):
    """launch.py in a process where `import mlflow` fails, as on a GPU node without it (it is
    installed here, so the failure is simulated)."""
    store = f"sqlite:///{tmp_path}/store/x.db"
    code = ("import runpy, sys; sys.modules['mlflow'] = None; "
            f"sys.argv = [{str(ROOT / 'launch.py')!r}, *sys.argv[1:]]; runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code, *SHORT, f"tracking.uri={store}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    (warning,) = [line for line in output.splitlines() if "MLflow" in line and "MLflow run" not in line]
    assert warning.startswith("MLflow is not importable (No module named 'mlflow")
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert f"journal only, {run_dir}/mlflow/journal.jsonl" in warning
    assert sorted(journal_metrics(run_dir)) == [0, 1, 2]


def test_a_sqlite_store_keeps_the_artifacts_beside_it(tmp_path):
    cwd, store = tmp_path / "cwd", tmp_path / "store"
    cwd.mkdir()
    done = run_launch([*SHORT, f"tracking.uri=sqlite:///{store}/X.db", "tracking.experiment=beside"], cwd=cwd)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert os.listdir(cwd) == ["outputs"]  # the run dir and nothing else: no ./mlruns

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{store}/X.db")
    (run,) = client.search_runs([client.get_experiment_by_name("beside").experiment_id])
    assert run.info.status == "FINISHED"
    record = store / "artifacts" / run.info.run_id / "artifacts" / "run_record"
    assert {"resolved.yaml", "git.json", "env.json"} <= set(os.listdir(record))
