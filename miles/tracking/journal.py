"""MLflow tracking that never stops training: every call goes to a local journal first, to MLflow
when it answers.

Each tracking call (params, metrics, artifacts, tables, the final status) is appended to
`<run dir>/mlflow/journal.jsonl` and then sent by one background thread, in order. When the server
does not answer, the thread keeps the entry and retries with backoff while training goes on; when
it answers again the backlog goes up with the metrics' original timestamps. `finish` waits up to
`tracking.flush_timeout_s` for the backlog; what is still not uploaded then is reported, with the
command that uploads it later (the journal's `state.json` says how far uploads got):

    python -m miles.tracking.journal <run dir>

Where MLflow cannot be used at all (not importable, as on a GPU node without it, or the server
refuses to create the run), the run logs to the journal only, says so once, and goes on.
No MLflow failure prints a traceback or changes the run's exit status.
"""

from __future__ import annotations

import json
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from miles.config.flat import flatten
from miles.config.schema import TrackingCfg
from miles.tracking.mlflow_logger import MlflowLogger, resolve_uri

JOURNAL, STATE = "journal.jsonl", "state.json"
# Fail fast inside MLflow's client (its default retries for minutes per call); the thread retries.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
MAX_BACKOFF_S = 10.0
# The upload thread gathers what is logged for this long after an entry, then sends consecutive
# steps' metrics in one request: one step's MLflow log_batch into SQLite costs ~5 ms of CPU (2-core
# machine, 25 metrics), 20 steps' together ~1.5 ms a step, and that CPU is taken from training.
GATHER_S = 2.0


def transient(error: Exception) -> bool:
    """Worth retrying: the server is unreachable or failing (5xx), not refusing the entry (4xx).
    MlflowException is recognised by its method, so that judging an error never imports mlflow."""
    status = getattr(error, "get_http_status_code", None)
    if callable(status):
        return status() >= 500
    return isinstance(error, (ConnectionError, TimeoutError))


def reason(error: Exception) -> str:
    """An error in a few words: the OS's cause where MLflow buries one in a long HTTP error line
    ("[Errno 111] Connection refused"), else the first line of the message."""
    text = str(error) or type(error).__name__
    causes = re.findall(r"\[Errno -?\d+\] [^\"'()]+", text)
    return causes[-1].strip() if causes else text.splitlines()[0][:160]


class Journal:
    """The on-disk record: entries in order, and the run id / last uploaded entry in state.json."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / JOURNAL

    def append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def entries(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()] if self.path.exists() else []

    def state(self) -> dict:
        return json.loads((self.dir / STATE).read_text())

    def save_state(self, state: dict) -> None:
        tmp = self.dir / f"{STATE}.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, self.dir / STATE)


class Uploader:
    """Sends journal entries to MLflow, creating the run on first contact."""

    def __init__(self, journal: Journal, state: dict, connect: Callable = MlflowLogger, uri_key: str = "uri"):
        self.journal, self.state, self.connect, self.uri_key = journal, state, connect, uri_key
        self.logger = None

    def ensure_run(self) -> None:
        if self.logger is None:
            cfg = TrackingCfg(uri=self.state[self.uri_key], experiment=self.state["experiment"])
            self.logger = self.connect(cfg, self.state["run_name"], self.state["tags"], run_id=self.state["run_id"])
            self.state["run_id"] = self.logger.run_id
            self.journal.save_state(self.state)

    @staticmethod
    def groups(entries: list[dict]) -> list[list[dict]]:
        """`entries` in order as what goes up in one request each: a run of consecutive metrics
        entries together, any other entry alone."""
        out: list[list[dict]] = []
        for entry in entries:
            if out and entry["op"] == "metrics" and out[-1][-1]["op"] == "metrics":
                out[-1].append(entry)
            else:
                out.append([entry])
        return out

    def send(self, entries: list[dict]) -> None:
        """One entry, or several metrics entries (one request)."""
        self.ensure_run()
        entry, lg = entries[-1], self.logger
        op = entry["op"]
        if op == "params":
            lg.log_params(entry["params"])
        elif op == "metrics":
            lg.log_metric_steps([(e["metrics"], e["step"], e["time_ms"]) for e in entries])
        elif op == "artifact":
            lg.log_artifact(entry["path"], entry["artifact_path"])
        elif op == "table":
            lg.log_table(entry["rows"], entry["artifact_file"])
        elif op == "finish":
            lg.finish(entry["status"])
        self.state["uploaded"] = entry["seq"]
        self.journal.save_state(self.state)


class JournaledTracker:
    """MlflowLogger's interface; calls return at once (after the journal write), uploads run behind."""

    def __init__(self, cfg: TrackingCfg, run_name: str, tags: dict[str, str], run_dir: str | Path,
                 log: Callable[[str], None] = print, connect: Callable = MlflowLogger):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.cfg, self.log = cfg, log
        self.journal = Journal(Path(run_dir) / "mlflow")
        # `store`, the resolved URI, lets `python -m miles.tracking.journal` run from another directory.
        state = {"uri": cfg.uri, "store": resolve_uri(cfg.uri), "experiment": cfg.experiment, "run_name": run_name, "tags": tags,
                 "run_id": None, "uploaded": 0}
        self.journal.save_state(state)
        self.uploader = Uploader(self.journal, state, connect)
        self._seq = 0
        self._queue: queue.Queue = queue.Queue()
        self._give_up = threading.Event()
        self.offline_since: float | None = None
        self.local_only = False
        try:  # the usual case: the run exists (and has an id to print) before training starts
            self.uploader.ensure_run()
        except ImportError as error:  # no MLflow here (or a package its store needs): nothing to retry
            self._keep_local(f"MLflow is not importable ({reason(error)})")
        except Exception as error:
            if transient(error):
                self._went_offline(error)
            else:
                self._keep_local(f"MLflow at {self.uri} refused to create the run ({reason(error)})")
        self._thread = threading.Thread(target=self._work, name="mlflow-journal", daemon=True)
        if not self.local_only:
            self._thread.start()

    @property
    def run_id(self) -> str | None:
        return self.uploader.state["run_id"]

    @property
    def uri(self) -> str:
        return self.uploader.state["store"]

    # ---------------------------------------------------------------- the MlflowLogger interface
    def _put(self, op: str, **fields) -> None:
        self._seq += 1
        entry = {"op": op, "seq": self._seq, **fields}
        self.journal.append(entry)
        if not self.local_only:
            self._queue.put(entry)

    def log_params(self, params: dict) -> None:
        self._put("params", params=flatten(params))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._put("metrics", metrics={k: float(v) for k, v in metrics.items()}, step=step,
                  time_ms=int(time.time() * 1000))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._put("artifact", path=str(Path(path).absolute()), artifact_path=artifact_path)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        self._put("table", rows=rows, artifact_file=artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        """Queue the final status and wait for the uploads: as long as they go on, and at most
        tracking.flush_timeout_s while the server does not answer."""
        self._put("finish", status=status)
        start = time.time()
        while self._thread.is_alive():  # never started when local only
            self._thread.join(0.2)
            offline = self.offline_since
            if offline is not None and time.time() - max(start, offline) > self.cfg.flush_timeout_s:
                self._give_up.set()
                self._report_backlog()
                return

    # ---------------------------------------------------------------- the upload thread
    def _keep_local(self, what: str) -> None:
        self.local_only = True
        self.log(f"{what}: this run logs to its journal only, {self.journal.path}; upload it later with "
                 f"`python -m miles.tracking.journal {self.journal.dir.parent}`")

    def _went_offline(self, error: Exception) -> None:
        if self.offline_since is None:
            self.offline_since = time.time()
            self.log(f"MLflow unreachable at {self.uri} ({reason(error)}); training goes on, metrics are "
                     f"kept in {self.journal.path} and uploaded when it answers")

    def _gather(self) -> list[dict]:
        """The next entry and what follows it within GATHER_S (up to the final status)."""
        entries = [self._queue.get()]
        deadline = time.time() + GATHER_S
        while entries[-1]["op"] != "finish" and (left := deadline - time.time()) > 0:
            try:
                entries.append(self._queue.get(timeout=left))
            except queue.Empty:
                break
        return entries

    def _work(self) -> None:
        while not self._give_up.is_set():
            entries = self._gather()
            for group in self.uploader.groups(entries):
                self._send(group)
            if self.offline_since is not None and not self._give_up.is_set():
                self.log(f"MLflow reachable again after {time.time() - self.offline_since:.0f}s; "
                         "uploading the backlog")
                self.offline_since = None
            if entries[-1]["op"] == "finish":
                return

    def _send(self, group: list[dict]) -> None:
        """One request, retried with backoff while the server is unreachable (until finish gives up)."""
        backoff = 0.5
        while not self._give_up.is_set():
            try:
                self.uploader.send(group)
                return
            except Exception as error:
                if not transient(error):
                    self.log(f"MLflow refused a {group[0]['op']} entry ({reason(error)}); skipped, it stays in the journal")
                    return
                self._went_offline(error)
                self._give_up.wait(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)

    def _report_backlog(self) -> None:
        uploaded = self.uploader.state["uploaded"]
        pending = [e for e in self.journal.entries() if e["seq"] > uploaded]
        steps = sorted({e["step"] for e in pending if e["op"] == "metrics"})
        span = f", metrics of steps {steps[0]}..{steps[-1]}" if steps else ""
        self.log(f"MLflow still unreachable after {self.cfg.flush_timeout_s:g}s: {len(pending)} entries not "
                 f"uploaded{span}; they are in {self.journal.path}. Upload them later with:\n"
                 f"  python -m miles.tracking.journal {self.journal.dir.parent}")


def upload(run_dir: str | Path, connect: Callable = MlflowLogger) -> int:
    """Send what a run's journal holds beyond its last upload; returns the number of entries sent."""
    journal = Journal(Path(run_dir) / "mlflow")
    state = journal.state()
    uploader = Uploader(journal, state, connect, uri_key="store")
    pending = [e for e in journal.entries() if e["seq"] > state["uploaded"]]
    for group in uploader.groups(pending):
        uploader.send(group)
    return len(pending)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.exit("usage: python -m miles.tracking.journal <run dir>")
    run_dir = Path(argv[0])
    if not (run_dir / "mlflow" / STATE).exists():
        sys.exit(f"error: {run_dir} holds no tracking journal (mlflow/{STATE})")
    try:
        sent = upload(run_dir)
    except ImportError as error:
        sys.exit(f"error: MLflow is not importable ({reason(error)}); install mlflow-skinny "
                 "(requirements/gpu-node.txt) and run this again")
    except Exception as error:  # what went up is in state.json: a second call sends only the rest
        sys.exit(f"error: upload stopped ({reason(error)}); run this again to send the rest")
    print(f"uploaded {sent} journal entries of {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
