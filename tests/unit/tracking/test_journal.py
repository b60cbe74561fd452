"""The tracking journal: training never waits for MLflow; a backlog goes up in order when it answers;
what never went up is reported and uploaded later from the run dir. MLflow missing or unreachable
costs one line of output, never a traceback."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from miles.config.schema import TrackingCfg
from miles.tracking.journal import JournaledTracker, upload


class FakeServer:
    """Stands in for MLflow: `up` is switched by the test; records what reached it."""

    def __init__(self, up=True):
        self.up = threading.Event()
        if up:
            self.up.set()
        self.metrics: list[tuple[int, dict, int]] = []
        self.status = None
        self.runs = 0
        self.requests = 0  # metrics requests

    def logger(self, cfg, run_name, tags, run_id=None):
        server = self

        def check():
            if not server.up.is_set():
                raise MlflowException("API request failed with exception ConnectionRefused")

        class Logger:
            def __init__(self):
                check()
                if run_id is None:
                    server.runs += 1
                self.run_id = run_id or f"run{server.runs}"

            def log_params(self, params):
                check()

            def log_metric_steps(self, rows):
                check()
                server.requests += 1
                server.metrics.extend((step, metrics, time_ms) for metrics, step, time_ms in rows)

            def log_artifact(self, path, artifact_path):
                check()

            def log_table(self, rows, artifact_file):
                check()

            def finish(self, status):
                check()
                server.status = status

        return Logger()


def tracking(timeout=30.0):
    return TrackingCfg(uri="http://mlflow.invalid:5000", flush_timeout_s=timeout)


def test_backlog_uploads_in_order_when_the_server_returns(tmp_path):
    server = FakeServer()
    messages = []
    tracker = JournaledTracker(tracking(), "r", {}, tmp_path, log=messages.append, connect=server.logger)
    assert tracker.run_id == "run1"
    tracker.log_params({"a": {"b": 1}})
    tracker.log_metrics({"x": 1.0}, 1)
    server.up.clear()
    for step in range(2, 6):
        tracker.log_metrics({"x": float(step)}, step)  # returns at once while the server is down
    threading.Timer(1.0, server.up.set).start()
    tracker.finish("FINISHED")
    assert [s for s, _, _ in server.metrics] == [1, 2, 3, 4, 5]
    assert server.status == "FINISHED" and server.runs == 1
    assert any("unreachable" in m for m in messages) and any("reachable again" in m for m in messages)


def test_steps_logged_together_go_up_in_one_request(tmp_path):
    server = FakeServer()
    tracker = JournaledTracker(tracking(), "r", {}, tmp_path, connect=server.logger)
    for step in range(1, 6):  # within GATHER_S of each other: one log_batch, at finish at the latest
        tracker.log_metrics({"x": float(step)}, step)
    tracker.finish("FINISHED")
    assert [(s, m) for s, m, _ in server.metrics] == [(s, {"x": float(s)}) for s in range(1, 6)]
    assert server.requests == 1 and server.status == "FINISHED"


def test_unreachable_at_the_end_is_reported_then_uploaded_later(tmp_path):
    server = FakeServer(up=False)  # down from the start: the run is created later
    messages = []
    tracker = JournaledTracker(tracking(timeout=0.5), "r", {"t": "1"}, tmp_path, log=messages.append,
                               connect=server.logger)
    assert tracker.run_id is None
    for step in range(1, 4):
        tracker.log_metrics({"x": float(step)}, step)
    tracker.finish("FINISHED")
    assert server.metrics == []
    assert "4 entries not uploaded, metrics of steps 1..3" in messages[-1]  # 3 metrics + the final status
    assert f"python -m miles.tracking.journal {tmp_path}" in messages[-1]

    server.up.set()
    assert upload(tmp_path, connect=server.logger) == 4
    assert [s for s, _, _ in server.metrics] == [1, 2, 3] and server.status == "FINISHED"
    assert upload(tmp_path, connect=server.logger) == 0  # nothing twice


def test_a_server_that_refuses_the_run_leaves_the_run_on_its_journal_with_one_line(tmp_path):
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    def refuse(cfg, run_name, tags, run_id=None):  # a 403: retrying would not help
        raise MlflowException("Permission denied on experiment 'miles'", error_code=PERMISSION_DENIED)

    messages = []
    tracker = JournaledTracker(tracking(timeout=30), "r", {}, tmp_path, log=messages.append, connect=refuse)
    for step in range(1, 4):
        tracker.log_metrics({"x": float(step)}, step)
    start = time.time()
    tracker.finish("FINISHED")
    assert time.time() - start < 1  # nothing to wait for: no upload thread
    assert messages == [
        "MLflow at http://mlflow.invalid:5000 refused to create the run (Permission denied on experiment 'miles'): "
        f"this run logs to its journal only, {tmp_path}/mlflow/journal.jsonl; upload it later with "
        f"`python -m miles.tracking.journal {tmp_path}`"
    ]
    assert len((tmp_path / "mlflow" / "journal.jsonl").read_text().splitlines()) == 4


# ---------------------------------------------------------------- real MLflow, in a fresh process
# A subprocess, so that what the upload thread prints reaches a real stderr (a traceback would).
ROOT = Path(__file__).resolve().parents[3]
TRAIN = """
import sys
{prelude}
from miles.config.schema import TrackingCfg
from miles.tracking.journal import JournaledTracker

tracker = JournaledTracker(TrackingCfg(uri={uri!r}, experiment="x", flush_timeout_s=0.5), "r", {{}}, {run_dir!r})
for step in range(1, 4):
    tracker.log_metrics({{"x": float(step)}}, step)
tracker.finish("FINISHED")
print("training done")
"""
# Stands in for a machine without MLflow, which cannot exist in this venv (it is installed).
NO_MLFLOW = "sys.modules['mlflow'] = None"


def python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def upload_cli(run_dir: Path, prelude: str = "") -> subprocess.CompletedProcess:
    return python(f"import sys\n{prelude}\nfrom miles.tracking.journal import main\nsys.exit(main([{str(run_dir)!r}]))",
                  run_dir.parent)


def free_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_mlflow_the_run_logs_to_its_journal_only_with_one_warning(tmp_path):
    run_dir, store = tmp_path / "run", f"sqlite:///{tmp_path}/store/x.db"
    done = python(TRAIN.format(prelude=NO_MLFLOW, uri=store, run_dir=str(run_dir)), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr and done.stderr == ""
    warning, last = done.stdout.splitlines()  # one warning, then training went on to the end
    assert warning.startswith("MLflow is not importable (No module named 'mlflow")
    assert f"journal only, {run_dir}/mlflow/journal.jsonl" in warning
    assert warning.endswith(f"`python -m miles.tracking.journal {run_dir}`") and last == "training done"
    ops = [json.loads(line)["op"] for line in (run_dir / "mlflow" / "journal.jsonl").read_text().splitlines()]
    assert ops == ["metrics", "metrics", "metrics", "finish"]

    refused = upload_cli(run_dir, prelude=NO_MLFLOW)  # uploading needs MLflow: says so, no traceback
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("error: MLflow is not importable (No module named 'mlflow")

    assert upload(run_dir) == 4  # where MLflow is installed the journal goes up whole
    client = MlflowClient(store)
    run = client.get_run(json.loads((run_dir / "mlflow" / "state.json").read_text())["run_id"])
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "x")] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_an_unreachable_server_gives_one_line_and_the_upload_command(tmp_path):
    run_dir, uri = tmp_path / "run", f"http://127.0.0.1:{free_port()}"
    done = python(TRAIN.format(prelude="", uri=uri, run_dir=str(run_dir)), tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stdout + done.stderr and done.stderr == ""
    unreachable, backlog, command, last = done.stdout.splitlines()
    assert unreachable.startswith(f"MLflow unreachable at {uri} ([Errno 111] Connection refused); training goes on")
    assert backlog.startswith("MLflow still unreachable after 0.5s: 4 entries not uploaded, metrics of steps 1..3")
    assert command == f"  python -m miles.tracking.journal {run_dir}" and last == "training done"

    later = upload_cli(run_dir)  # still nothing listening: a one-line error, the journal untouched
    assert later.returncode == 1 and "Traceback" not in later.stderr
    assert later.stderr.strip() == "error: upload stopped ([Errno 111] Connection refused); run this again to send the rest"
    assert json.loads((run_dir / "mlflow" / "state.json").read_text())["uploaded"] == 0
