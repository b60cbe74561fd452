"""Every precision recipe runs 2 RL steps end to end in-process, with the checked weight sync
(the engine's held FP8 / INT4 tensors equal what the trainer's quantizer produced), and the
first-step invariant of the trainer's own quantized forward (ppo_kl == 0)."""

from pathlib import Path

import pytest

from miles.config.validate import validate
from miles.orchestrate.run import run

pytestmark = pytest.mark.slow
RECIPES = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "conf" / "precision").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps_with_checked_sync(tmp_path, monkeypatch, compose, recipe):
    monkeypatch.chdir(tmp_path)
    store = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = compose([f"precision={recipe}", "ray.enabled=false", "steps=2", "eval.interval=2", "task.eval_size=8",
                   "warm_start.enabled=false", "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
                   "trainer.global_batch_size=16", "trainer.micro_batch_size=8", "tracking.log_samples=0",
                   "rollout.check_weight_sync=true", f"tracking.uri={store}"])
    assert validate(cfg) == []
    run(cfg, tmp_path / "run", [f"precision={recipe}"], "")  # a checksum mismatch would raise

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (record,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    first = {m.step: m.value for m in client.get_metric_history(record.info.run_id, "train/ppo_kl")}
    assert first[1] == 0.0
    mismatch = [m.value for m in client.get_metric_history(record.info.run_id, "mismatch/logprob_abs_diff")]
    assert len(mismatch) == 2 and all(v >= 0 for v in mismatch)
