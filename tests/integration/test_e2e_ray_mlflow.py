"""End to end on real parts: local Ray actors, a real MLflow tracking server, a warm start built
from scratch, and a 2-step GRPO run; then the MLflow record is checked metric by metric.
"""

import pytest

from launch_cli import run_launch

pytestmark = pytest.mark.slow

SMALL = [
    "steps=2", "eval.interval=1", "task.eval_size=16",
    "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
    "warm_start.steps=10", "warm_start.check_interval=5",
]
STEP_METRICS = [
    "rollout/reward_mean", "rollout/response_len_mean", "rollout/tokens_per_s", "train/loss", "train/pg_loss",
    "train/ppo_kl", "train/pg_clipfrac", "train/entropy", "train/grad_norm", "mismatch/logprob_abs_diff",
    "perf/step_time_s", "perf/rollout_time_s", "perf/train_time_s", "perf/weight_sync_s",
]


def test_two_step_grpo_on_ray_logs_everything_to_mlflow(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    proc = run_launch([*SMALL, f"tracking.uri={mlflow_server}", "tracking.experiment=e2e"], cwd=tmp_path,
                      env_extra={"MILES_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "building the warm-start SFT checkpoint" in proc.stdout
    assert "Effective batch" in proc.stdout and "rollout.n_samples_per_prompt" in proc.stdout

    client = MlflowClient(tracking_uri=mlflow_server)
    exp = client.get_experiment_by_name("e2e")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer.lr"] == "0.0005" and run.data.params["rollout.batch_size"] == "4"
    assert len(run.data.tags["mlflow.source.git.commit"]) == 40

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    for key in STEP_METRICS:
        assert set(history(key)) == {1, 2}, key
    # the first (and only) optimizer step of each rollout is exactly on-policy
    assert history("train/ppo_kl") == {1: 0.0, 2: 0.0}
    assert history("train/pg_clipfrac") == {1: 0.0, 2: 0.0}
    assert max(history("mismatch/logprob_abs_diff").values()) < 1e-4
    assert set(history("eval/arithmetic/accuracy")) == {0, 1, 2}

    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "run_record")}
    assert {f"run_record/{n}" for n in ("resolved.yaml", "overrides.yaml", "git.json", "git.diff", "env.json")} <= artifacts
    samples = {a.path for a in client.list_artifacts(run.info.run_id, "samples")}
    assert "samples/step_00002.json" in samples

    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    assert (run_dir / "resolved.yaml").exists() and (run_dir / ".hydra" / "overrides.yaml").exists()
    assert (run_dir / "checkpoint" / "model.safetensors").exists()

    # the warm start is cached: a second run does not rebuild it
    again = run_launch([*SMALL, "steps=1", "ray.enabled=false", f"tracking.uri={mlflow_server}"], cwd=tmp_path,
                       env_extra={"MILES_CACHE_DIR": str(tmp_path / "cache")})
    assert again.returncode == 0, again.stderr[-2000:]
    assert "building the warm-start" not in again.stdout


@pytest.mark.no_ray
def test_multirun_groups_jobs_under_one_parent_run(tmp_path):
    from mlflow.tracking import MlflowClient

    # In-process, one step per job: the grouping is what is tested (Ray and the metrics: the test above).
    proc = run_launch(["-m", "trainer.lr=1e-4,3e-4", *SMALL, "steps=1", "ray.enabled=false", "warm_start.enabled=false",
                       "tracking.experiment=sweep"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    exp = client.get_experiment_by_name("sweep")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert sorted(c.data.params["trainer.lr"] for c in children) == ["0.0001", "0.0003"]
    assert parents[0].data.tags["miles.num_jobs"] == "2"
    assert "sweep/best_objective" in parents[0].data.metrics
