"""PPO trains its critic, OPD pulls the student towards its teacher: short in-process runs of the
built-in arithmetic task through `miles.orchestrate.run`, read back from a real MLflow store."""

from statistics import mean

import pytest
from omegaconf import OmegaConf

from miles.validate import validate
from miles.orchestrate.run import run

pytestmark = pytest.mark.slow
SMALL = ["ray.enabled=false", "task.eval_size=8", "warm_start.enabled=false", "rollout.batch_size=8",
         "rollout.n_samples_per_prompt=4", "trainer.global_batch_size=32", "trainer.micro_batch_size=16",
         "tracking.log_samples=0"]


def _run(compose, tmp_path, overrides):
    store = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = compose([*SMALL, *overrides, f"tracking.uri={store}"])
    assert validate(cfg) == []
    run(cfg, tmp_path / "run", overrides, OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store)
    (record,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    return lambda key: {m.step: m.value for m in client.get_metric_history(record.info.run_id, key)}


def _series(history: dict[int, float]) -> str:
    return " ".join(f"{history[s]:.3f}" for s in sorted(history))


@pytest.mark.no_ray
def test_ppo_trains_its_critic(tmp_path, monkeypatch, compose):
    # From a random init the exact-match reward is always 0 and the critic would have nothing to fit;
    # DAPO's overlong penalty (over the last 4 of 8 tokens) makes the reward depend on the response.
    monkeypatch.chdir(tmp_path)
    history = _run(compose, tmp_path, ["algo=ppo", "steps=8", "eval.interval=8", "algo.overlong_buffer=4",
                                       "critic.warmup_steps=5", "critic.updates_per_step=2"])
    value_loss = history("critic/value_loss")
    assert sorted(value_loss) == list(range(1, 9))
    # The critic alone, on a policy that does not move: the value loss halves within 5 steps...
    assert mean(value_loss[s] for s in (4, 5)) < 0.5 * mean(value_loss[s] for s in (1, 2)), _series(value_loss)
    # ...and stays below where it started once the policy moves too.
    assert max(value_loss[s] for s in (6, 7, 8)) < value_loss[1], _series(value_loss)
    for key in ("critic/value_mean", "critic/vf_clipfrac", "critic/explained_var", "critic/grad_norm"):
        assert sorted(history(key)) == list(range(1, 9)), key
    # critic warm-up: no policy update (and no weight sync) in the first 5 steps
    assert sorted(history("train/pg_loss")) == [6, 7, 8]
    assert sorted(history("perf/weight_sync_s")) == [6, 7, 8]


@pytest.mark.no_ray
def test_opd_reverse_kl_falls(tmp_path, monkeypatch, compose, teacher):
    monkeypatch.chdir(tmp_path)
    history = _run(compose, tmp_path, ["algo=opd", "steps=10", "eval.interval=10", "trainer.lr=2e-3",
                                       f"algo.teacher_checkpoint={teacher}"])
    reverse_kl = history("train/reverse_kl")
    assert sorted(reverse_kl) == list(range(1, 11))
    first, last = mean(reverse_kl[s] for s in (1, 2)), mean(reverse_kl[s] for s in (8, 9, 10))
    assert last < 0.75 * first, _series(reverse_kl)


def test_ppo_critic_runs_as_a_ray_actor(tmp_path, monkeypatch, compose):
    # The same spawn() as the engine and the trainer, on the run's local Ray (a CPU for each of the three).
    monkeypatch.chdir(tmp_path)
    history = _run(compose, tmp_path, ["algo=ppo", "steps=2", "eval.interval=2", "ray.enabled=true"])
    assert sorted(history("critic/value_loss")) == [1, 2] and sorted(history("train/pg_loss")) == [1, 2]
