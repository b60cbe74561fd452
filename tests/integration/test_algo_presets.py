"""Every algorithm preset runs 2 RL steps end to end, in-process (the loop Ray drives, without the
actors), through `miles.orchestrate.run` with a real MLflow store shared by the presets."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from miles.validate import validate
from miles.orchestrate.run import run

pytestmark = pytest.mark.slow
PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "algo").glob("*.yaml"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "sft"])
def test_preset_runs_two_steps(tmp_path, monkeypatch, compose, store, preset, request):
    monkeypatch.chdir(tmp_path)
    # opd's default teacher is built by a minutes-long SFT; a short one stands in for it here.
    teacher = [f"algo.teacher_checkpoint={request.getfixturevalue('teacher')}"] if preset == "opd" else []
    cfg = compose([f"algo={preset}", "ray.enabled=false", "steps=2", "eval.interval=2", "task.eval_size=8",
                   "warm_start.enabled=false", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
                   "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "tracking.log_samples=0",
                   f"tracking.uri={store}", f"tracking.experiment={preset}", *teacher])
    assert validate(cfg) == []
    accuracy = run(cfg, tmp_path / "run", [f"algo={preset}"], OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert 0.0 <= accuracy <= 1.0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (record,) = client.search_runs([client.get_experiment_by_name(preset).experiment_id])
    assert record.data.params["algo.name"] == preset
    steps = {m.step for m in client.get_metric_history(record.info.run_id, "train/pg_loss")}
    assert steps == {1, 2}
    assert json.loads((tmp_path / "run" / "checkpoint" / "config.json").read_text())["model_type"] == "qwen3"
