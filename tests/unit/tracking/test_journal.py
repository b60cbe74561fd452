"""The tracking journal: training never waits for MLflow; a backlog goes up in order when it answers;
what never went up is reported and uploaded later from the run dir."""

import threading

from miles.config.schema import TrackingCfg
from miles.tracking.journal import JournaledTracker, upload
from mlflow.exceptions import MlflowException


class FakeServer:
    """Stands in for MLflow: `up` is switched by the test; records what reached it."""

    def __init__(self, up=True):
        self.up = threading.Event()
        if up:
            self.up.set()
        self.metrics: list[tuple[int, dict, int]] = []
        self.status = None
        self.runs = 0

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

            def log_metrics(self, metrics, step, time_ms):
                check()
                server.metrics.append((step, metrics, time_ms))

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
