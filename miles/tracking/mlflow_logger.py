"""MLflow tracking for one run: params (the flattened resolved config), per-step metrics, artifacts.

Only the driver logs. With `tracking.uri: null` the store is local (SQLite under ./mlruns, no server);
`tracking.uri=sqlite:///path/X.db` puts it elsewhere; either way the artifacts go to `artifacts/`
beside the database file, so a run writes nothing into the working directory but its run dir.
Set `tracking.uri=http://host:5000` for a server (it picks the artifacts' place). Inside a sweep
(see miles.tracking.sweep) the run becomes a child of the sweep's parent run.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from miles.config.flat import flatten
from miles.config.schema import TrackingCfg
from miles.tracking.run_record import REPRODUCE_OF_ENV

PARENT_RUN_ENV = "MILES_MLFLOW_PARENT_RUN_ID"
SWEEP_DIR_ENV = "MILES_SWEEP_DIR"


SQLITE = "sqlite:///"


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (a relative path counts from the working
    directory, as for SQLAlchemy), else None (a server, or SQLite in memory)."""
    if not uri.startswith(SQLITE):
        return None
    path = uri[len(SQLITE):].partition("?")[0]
    return Path(path).absolute() if path and path != ":memory:" else None


def resolve_uri(uri: str | None) -> str:
    """The store's URI as it works from any directory: the default local store, or a SQLite path made
    absolute (the journal uploads later from wherever it is called; sweep jobs share the store)."""
    if not uri:
        uri = f"{SQLITE}mlruns/mlflow.db"
    db = sqlite_file(uri)
    if db is None:
        return uri
    db.parent.mkdir(parents=True, exist_ok=True)  # SQLite creates the file, not its folder
    query = uri.partition("?")[2]
    return f"{SQLITE}{db}" + (f"?{query}" if query else "")


def seed_sqlite_store(uri: str) -> None:
    """Where `uri` (resolved) names a SQLite file that does not exist yet: start it as a copy of an empty
    store with MLflow's schema, built once per MLflow version in the user's cache (~/.cache/miles).
    MLflow creating the file runs its ~50 schema migrations: ~1.5 s of CPU for every run with a store
    of its own (measured: a new store 1.4-1.5 s, a copied one 0.03 s). The copy holds no experiment, so
    MLflow adds its Default one on opening it, as in a new file. Any failure here leaves the file to
    MLflow, as before."""
    import shutil

    db = sqlite_file(uri)
    if db is None or db.exists():
        return
    try:
        template = _empty_store()
        tmp = db.with_name(f".{db.name}.{os.getpid()}.tmp")
        shutil.copyfile(template, tmp)
        try:
            os.link(tmp, db)  # never over a store another process has just created
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    except Exception:  # noqa: BLE001  (a cache: whatever went wrong, MLflow creates the file as before)
        return


def _empty_store() -> Path:
    import sqlite3

    import mlflow
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles"
    template = cache / f"mlflow-{mlflow.__version__}-empty.db"
    if template.exists():
        return template
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{template.name}.{os.getpid()}.tmp"
    tmp.unlink(missing_ok=True)
    store = SqlAlchemyStore(f"{SQLITE}{tmp}", (cache / "unused-artifacts").as_uri())
    store.engine.dispose()
    with sqlite3.connect(tmp) as con:  # the Default experiment (artifacts under the cwd of the time) goes
        con.execute("DELETE FROM experiment_tags")
        con.execute("DELETE FROM experiments")
    con.close()
    os.replace(tmp, template)
    return template


def get_or_create_experiment(client, name: str, uri: str | None) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    # A SQLite store keeps its artifacts beside the database (MLflow's default would be ./mlruns of
    # the working directory); a server picks its own location.
    db = sqlite_file(resolve_uri(uri))
    location = (db.parent / "artifacts").as_uri() if db is not None else None
    return client.create_experiment(name, artifact_location=location)


class MlflowLogger:
    def __init__(self, cfg: TrackingCfg, run_name: str, tags: dict[str, str] | None = None,
                 run_id: str | None = None):
        """Creates the run, or with `run_id` logs to that existing one (miles.tracking.journal uploads)."""
        from mlflow.tracking import MlflowClient

        self.uri = resolve_uri(cfg.uri)
        seed_sqlite_store(self.uri)
        self.client = MlflowClient(tracking_uri=self.uri)
        if run_id is not None:
            self.run_id = run_id
            self.experiment_id = self.client.get_run(run_id).info.experiment_id
            return
        experiment_id = get_or_create_experiment(self.client, cfg.experiment, cfg.uri)
        tags = dict(tags or {})
        if os.environ.get(PARENT_RUN_ENV):
            tags["mlflow.parentRunId"] = os.environ[PARENT_RUN_ENV]
        if os.environ.get(SWEEP_DIR_ENV):
            tags["miles.sweep_dir"] = os.environ[SWEEP_DIR_ENV]
        if os.environ.get(REPRODUCE_OF_ENV):
            tags["miles.reproduce_of"] = os.environ[REPRODUCE_OF_ENV]
        run = self.client.create_run(experiment_id, run_name=run_name, tags=tags)
        self.run_id = run.info.run_id
        self.experiment_id = experiment_id

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int, timestamp_ms: int | None = None) -> None:
        """`timestamp_ms`: when the values were measured (a delayed upload keeps it); default now."""
        self.log_metric_steps([(metrics, step, timestamp_ms or int(time.time() * 1000))])

    def log_metric_steps(self, rows: list[tuple[dict[str, float], int, int]]) -> None:
        """Several steps' metrics, (metrics, step, timestamp_ms) each, in as few requests as MLflow
        takes (1000 values each): one SQLite transaction costs ~5 ms of CPU whatever it holds."""
        from mlflow.entities import Metric

        items = [Metric(k, float(v), time_ms, step) for metrics, step, time_ms in rows for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_table(self, rows: list[dict], artifact_file: str) -> None:
        columns = {key: [row[key] for row in rows] for key in rows[0]} if rows else {}
        self.client.log_table(self.run_id, data=columns, artifact_file=artifact_file)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
