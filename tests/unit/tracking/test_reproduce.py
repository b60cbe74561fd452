"""+reproduce=<run dir | MLflow run id> turns into the recorded overrides before Hydra composes."""

import json

import pytest
import yaml

from miles.config.errors import UserError
from miles.tracking import reproduce
from miles.tracking.run_record import REPRODUCE_OF_ENV, git_sha, write_run_record


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(REPRODUCE_OF_ENV, "")  # restored (unset) after the test
    d = tmp_path / "outputs" / "run"
    d.mkdir(parents=True)
    (d / "overrides.yaml").write_text(yaml.safe_dump(["+experiment=cpu_smoke", "trainer.lr=1e-4", "task.ops=+-*"]))
    (d / "git.json").write_text(json.dumps({"sha": git_sha(), "dirty": False}))
    return d


def test_argv_without_reproduce_is_unchanged():
    argv = ["launch.py", "-m", "trainer.lr=1e-4,3e-4", "--cfg", "job"]
    assert reproduce.expand_argv(argv) == argv


def test_the_recorded_overrides_replace_the_argument_and_later_ones_win(run_dir, capsys):
    argv = ["launch.py", f"+reproduce={run_dir}", "trainer.lr=5e-4", "ray.enabled=false"]
    assert reproduce.expand_argv(argv) == [
        "launch.py", "+experiment=cpu_smoke", "task.ops=+-*", "trainer.lr=5e-4", "ray.enabled=false"]
    err = capsys.readouterr().err
    assert "reproducing" in err and "warning" not in err  # same commit, clean tree: nothing to warn about


def test_a_different_commit_or_a_dirty_tree_is_warned_about(run_dir, capsys):
    (run_dir / "git.json").write_text(json.dumps({"sha": "0" * 40, "dirty": True}))
    reproduce.expand_argv(["launch.py", f"reproduce={run_dir}"])
    err = capsys.readouterr().err
    assert "ran at git 000000000000" in err and "uncommitted changes" in err


def test_hydra_overrides_file_is_enough(tmp_path, monkeypatch):
    monkeypatch.setenv(REPRODUCE_OF_ENV, "")  # restored (unset) after the test
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- steps=3\n")
    assert reproduce.expand_argv(["launch.py", f"+reproduce={tmp_path}"]) == ["launch.py", "steps=3"]


def test_a_run_record_round_trips(tmp_path, monkeypatch):
    """What write_run_record stores is what +reproduce replays, quoting included."""
    monkeypatch.setenv(REPRODUCE_OF_ENV, "")  # restored (unset) after the test
    overrides = ["task.ops=+-*", "tracking.run_name='a: b'", "rollout.stop_tokens=[x,y]", "+experiment=cpu_moe"]
    write_run_record(tmp_path, "seed: 7\ndeterministic: true\n", overrides, seed=7, deterministic=True)
    assert reproduce.expand_argv(["launch.py", f"+reproduce={tmp_path}"]) == ["launch.py", *overrides]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["seed"] == 7 and run["deterministic"] is True
    assert "gpus" in json.loads((tmp_path / "env.json").read_text())["hardware"]


def test_an_mlflow_run_id_is_looked_up_in_the_local_store(run_dir, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from miles.tracking.mlflow_logger import get_or_create_experiment, resolve_uri

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=resolve_uri(None))
    run_id = client.create_run(get_or_create_experiment(client, "repro", None)).info.run_id
    for name in ("overrides.yaml", "git.json"):
        client.log_artifact(run_id, str(run_dir / name), "run_record")
    assert reproduce.expand_argv(["launch.py", f"+reproduce={run_id}", "seed=3"]) == [
        "launch.py", "+experiment=cpu_smoke", "trainer.lr=1e-4", "task.ops=+-*", "seed=3"]


def test_an_mlflow_run_without_artifacts_falls_back_to_its_run_dir(run_dir, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from miles.tracking.mlflow_logger import get_or_create_experiment, resolve_uri

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(tracking_uri=resolve_uri(None))
    experiment = get_or_create_experiment(client, "repro", None)
    run_id = client.create_run(experiment, tags={"miles.run_dir": str(run_dir)}).info.run_id
    assert reproduce.expand_argv(["launch.py", f"+reproduce={run_id}"])[1] == "+experiment=cpu_smoke"
    lost = client.create_run(experiment, tags={"miles.run_dir": str(tmp_path / "gone")}).info.run_id
    with pytest.raises(UserError, match="is not here"):
        reproduce.expand_argv(["launch.py", f"+reproduce={lost}"])


@pytest.mark.parametrize("argv,message", [
    (["launch.py", "+reproduce="], "needs a run dir"),
    (["launch.py", "+reproduce=nope", "+reproduce=again"], "more than once"),
    (["launch.py", "+reproduce=0123abcd"], "no local MLflow store"),
])
def test_mistakes_are_user_errors(tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(UserError, match=message):
        reproduce.expand_argv(argv)


def test_a_dir_that_is_not_a_run_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no overrides.yaml"):
        reproduce.expand_argv(["launch.py", f"+reproduce={tmp_path}"])
