"""Where a SQLite store keeps its artifacts: beside the database file, never in ./mlruns of the
working directory (real MLflow, local stores in tmp dirs)."""

import os
from pathlib import Path

from mlflow.tracking import MlflowClient

from miles.config.schema import TrackingCfg
from miles.tracking.mlflow_logger import MlflowLogger, resolve_uri


def log_one_run(uri, tmp_path) -> MlflowLogger:
    """A run with a file artifact and a table, as a training run logs them."""
    record = tmp_path / "record.yaml"
    record.write_text("seed: 1\n")
    logger = MlflowLogger(TrackingCfg(uri=uri, experiment="beside"), "r")
    logger.log_artifact(record, "run_record")
    logger.log_table([{"prompt": "1+1=", "completion": "2"}], "samples/step_00001.json")
    logger.finish()
    return logger


def artifact_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_sqlite_store_keeps_artifacts_beside_the_database(tmp_path, monkeypatch):
    cwd, store = tmp_path / "cwd", tmp_path / "store"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    logger = log_one_run(f"sqlite:///{store}/X.db", tmp_path)

    assert os.listdir(cwd) == []  # no ./mlruns, nothing else
    assert artifact_files(store / "artifacts") == {
        f"{logger.run_id}/artifacts/run_record/record.yaml",
        f"{logger.run_id}/artifacts/samples/step_00001.json",
    }
    run = MlflowClient(f"sqlite:///{store}/X.db").get_run(logger.run_id)
    assert run.info.artifact_uri == (store / "artifacts" / logger.run_id / "artifacts").as_uri()


def test_a_relative_sqlite_path_counts_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert resolve_uri("sqlite:///sub/X.db") == f"sqlite:///{tmp_path}/sub/X.db"  # absolute, for later uploads
    logger = log_one_run("sqlite:///sub/X.db", tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["record.yaml", "sub"]
    assert sorted(os.listdir(tmp_path / "sub")) == ["X.db", "artifacts"]
    assert f"{logger.run_id}/artifacts/run_record/record.yaml" in artifact_files(tmp_path / "sub" / "artifacts")


def test_the_default_store_is_mlruns_with_its_artifacts_inside(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    logger = log_one_run(None, tmp_path)
    assert sorted(os.listdir(tmp_path / "mlruns")) == ["artifacts", "mlflow.db"]
    assert f"{logger.run_id}/artifacts/run_record/record.yaml" in artifact_files(tmp_path / "mlruns" / "artifacts")


def test_a_server_uri_and_sqlite_in_memory_are_left_as_they_are():
    assert resolve_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert resolve_uri("sqlite:///:memory:") == "sqlite:///:memory:"
