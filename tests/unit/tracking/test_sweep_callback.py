"""What the sweep callback reads from Hydra's config: the direction and the swept keys."""

from omegaconf import OmegaConf

from miles.tracking.sweep import _minimize, _swept_keys


def hydra_cfg(sweeper: dict, task: list[str]):
    return OmegaConf.create({"hydra": {"sweeper": sweeper, "overrides": {"task": task}}})


def test_best_is_the_maximum_unless_optuna_minimizes():
    assert not _minimize(hydra_cfg({"params": None}, []))  # basic sweeper: no direction
    assert not _minimize(hydra_cfg({"direction": "maximize"}, []))
    assert _minimize(hydra_cfg({"direction": "minimize"}, []))
    assert _minimize(hydra_cfg({"direction": "Direction.minimize"}, []))


def test_swept_keys_come_from_sweeper_params_and_command_line_sweeps():
    cfg = hydra_cfg(
        {"params": {"trainer.lr": "tag(log, interval(1e-4, 3e-3))", "seed": "0,1"}},
        ["+sweep=tpe_lr_clip", "steps=2", "algo.kl_coef=interval(0, 0.1)", "rollout.top_k=choice(0, 5)"],
    )
    assert _swept_keys(cfg) == {"trainer.lr", "seed", "algo.kl_coef", "rollout.top_k"}


def test_the_parent_run_records_the_best_job(tmp_path, monkeypatch, capsys):
    """The callback against a local MLflow store, fed the way Hydra's launcher feeds it."""
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from miles.tracking.mlflow_logger import PARENT_RUN_ENV, SWEEP_DIR_ENV, MlflowLogger, resolve_uri
    from miles.tracking.sweep import MlflowSweepCallback

    monkeypatch.chdir(tmp_path)
    for name in (PARENT_RUN_ENV, SWEEP_DIR_ENV):
        monkeypatch.setenv(name, "")  # the callback sets them; unset again after the test whatever happens
    sweep = {"dir": "multirun/x", "subdir": "0"}
    config = OmegaConf.create({
        "tracking": {"uri": None, "experiment": "sweep"},
        "hydra": {"sweep": sweep, "sweeper": {"_target_": "a.BasicSweeper", "params": None},
                  "overrides": {"task": ["trainer.lr=1e-4,3e-4", "steps=2"]}, "runtime": {"choices": {}}},
    })
    callback = MlflowSweepCallback()
    callback.on_multirun_start(config)
    for num, (lr, objective) in enumerate([("1e-4", 0.25), ("3e-4", 0.5)]):
        run_dir = str(tmp_path / f"job{num}")
        child = MlflowLogger(SimpleNamespace(uri=None, experiment="sweep"), f"job{num}",
                             tags={"miles.run_dir": run_dir})
        child.finish()
        job = OmegaConf.create({"hydra": {"job": {"num": num}, "runtime": {"output_dir": run_dir},
                                          "overrides": {"task": [f"trainer.lr={lr}", "steps=2"]}}})
        callback.on_job_end(job, SimpleNamespace(_return_value=objective))
    callback.on_multirun_end(config)

    client = MlflowClient(resolve_uri(None))
    parent = client.get_run(callback.parent_run_id)
    best_child = client.get_run(parent.data.tags["miles.best_run_id"])
    assert parent.data.metrics["sweep/best_objective"] == 0.5 and parent.data.tags["miles.best_job"] == "1"
    assert best_child.info.run_name == "job1" and best_child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert parent.data.params == {"best.trainer.lr": "3e-4"} and parent.info.status == "FINISHED"
    assert parent.data.tags["miles.best_overrides"] == "trainer.lr=3e-4 steps=2"
    assert "best of 2 jobs is job 1" in capsys.readouterr().out
