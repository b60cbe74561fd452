"""Sweeps and reproduction end to end, against a real MLflow server: a 2-trial Optuna TPE sweep is
one parent run with two child runs and its best trial; a deterministic CPU run reproduced from its
run dir and from its MLflow run id gives identical metrics."""

import pytest
import yaml
from launch_cli import run_launch

pytestmark = pytest.mark.slow

TINY = [
    "ray.enabled=false", "steps=2", "eval.interval=1", "task.eval_size=16",
    "rollout.batch_size=4", "rollout.n_samples_per_prompt=4",
    "trainer.global_batch_size=16", "trainer.micro_batch_size=8",
]
TIMING = ("perf/", "rollout/tokens_per_s")  # wall-clock measurements differ run to run by nature


def test_optuna_sweep_is_one_parent_run_with_a_child_per_trial_and_the_best_trial(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    proc = run_launch(["-m", "+sweep=tpe_lr_clip", "hydra.sweeper.n_trials=2", *TINY, "warm_start.enabled=false",
                       f"tracking.uri={mlflow_server}", "tracking.experiment=optuna"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=mlflow_server)
    runs = client.search_runs([client.get_experiment_by_name("optuna").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(children) == 2
    assert parent.data.tags["miles.sweeper"] == "OptunaSweeper" and parent.data.tags["miles.num_jobs"] == "2"
    assert all(c.info.status == "FINISHED" for c in children)
    assert len({c.data.params["trainer.lr"] for c in children}) == 2  # TPE proposed two learning rates

    best = next(c for c in children if c.info.run_id == parent.data.tags["miles.best_run_id"])
    assert parent.data.metrics["sweep/best_objective"] == max(c.data.metrics["final/objective"] for c in children)
    assert parent.data.metrics["sweep/best_objective"] == best.data.metrics["final/objective"]
    for key in ("trainer.lr", "algo.eps_clip", "algo.eps_clip_high"):
        assert float(parent.data.params[f"best.{key}"]) == float(best.data.params[key])
    (results,) = tmp_path.glob("multirun/*/*/optimization_results.yaml")  # Optuna's own summary
    assert "best_value" in results.read_text()

    # One trial reproduced alone composes its sweep file again (sweeps/ is found from this other cwd).
    (trial,) = tmp_path.glob("multirun/*/*/0")
    shown = run_launch([f"+reproduce={trial}", "--cfg", "job"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    lr = next(o for o in yaml.safe_load((trial / "overrides.yaml").read_text()) if o.startswith("trainer.lr="))
    assert "+sweep=tpe_lr_clip" in shown.stderr and f"lr: {lr.split('=')[1]}" in shown.stdout


def _metrics(client, run_id):
    run = client.get_run(run_id)
    history = {}
    for key in run.data.metrics:
        if not key.startswith(TIMING):
            history[key] = [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                                              key=lambda m: m.step)]
    return history


def test_reproduce_of_a_deterministic_run_gives_identical_metrics(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    # A short SFT warm start on one-digit sums: some rewards are non-zero, so the policy really moves.
    first = [*TINY, "deterministic=true", "task.num_digits=1", "warm_start.steps=40", "warm_start.check_interval=40",
             f"tracking.uri={mlflow_server}", "tracking.experiment=reproduce"]
    env = {"MILES_CACHE_DIR": str(tmp_path / "cache")}
    proc = run_launch(first, cwd=tmp_path, env_extra=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = tmp_path.glob("outputs/*/*")

    again = run_launch([f"+reproduce={run_dir}"], cwd=tmp_path, env_extra=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "reproducing" in again.stderr

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("reproduce").experiment_id
    original = next(r for r in client.search_runs([experiment]) if "miles.reproduce_of" not in r.data.tags)
    by_id = run_launch([f"+reproduce={original.info.run_id}", f"tracking.uri={mlflow_server}"], cwd=tmp_path,
                       env_extra=env)
    assert by_id.returncode == 0, by_id.stdout[-3000:] + by_id.stderr[-3000:]

    runs = client.search_runs([experiment], order_by=["attributes.start_time ASC"])
    assert len(runs) == 3
    assert runs[1].data.tags["miles.reproduce_of"] == str(run_dir.resolve())
    assert runs[2].data.tags["miles.reproduce_of"] == original.info.run_id
    reference = _metrics(client, original.info.run_id)
    assert max(v for _, v in reference["rollout/reward_mean"]) > 0  # a run that learned something
    assert max(v for _, v in reference["train/grad_norm"]) > 0
    for run in runs[1:]:
        assert run.data.params == original.data.params | {"output_dir": run.data.params["output_dir"]}
        assert _metrics(client, run.info.run_id) == reference  # bit for bit


def test_reproduce_of_something_that_is_not_a_run_is_a_user_error(tmp_path):
    proc = run_launch(["+reproduce=no-such-run"], cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: +reproduce=no-such-run: no such run dir" in proc.stderr
