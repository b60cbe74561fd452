"""Every tiny model variant (`conf/model/*_tiny.yaml`) runs 2 RL steps end to end on CPU,
in-process, through `miles.orchestrate.run` with a real MLflow store."""

from pathlib import Path

import pytest

from miles.validate import validate
from miles.orchestrate.run import run

pytestmark = pytest.mark.slow
TINY = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "model").glob("*_tiny.yaml"))


@pytest.mark.parametrize("model", TINY)
def test_tiny_variant_runs_two_rl_steps(tmp_path, monkeypatch, compose, model):
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = compose([f"model={model}", "ray.enabled=false", "steps=2", "eval.interval=2", "task.eval_size=8",
                   "warm_start.enabled=false", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
                   "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "tracking.log_samples=0",
                   f"tracking.uri={store}"])
    assert validate(cfg) == []
    accuracy = run(cfg, tmp_path / "run", [f"model={model}"], "")
    assert 0.0 <= accuracy <= 1.0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (record,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    steps = {m.step for m in client.get_metric_history(record.info.run_id, "train/pg_loss")}
    assert steps == {1, 2}
    history = client.get_metric_history(record.info.run_id, "mismatch/logprob_abs_diff")
    assert max(m.value for m in history) < 1e-4  # engine and trainer run the same modules
