"""Hydra callback that groups a multirun under one MLflow parent run.

`python launch.py -m trainer.lr=1e-4,3e-4` creates a parent run named after the sweep dir; each
job's run is its child (tag mlflow.parentRunId) and carries the tag miles.sweep_dir. At the end the
parent records the best job's objective (the value launch.py's main returns: final eval accuracy).
"""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from miles.tracking.mlflow_logger import PARENT_RUN_ENV, SWEEP_DIR_ENV, get_or_create_experiment, resolve_uri


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.client = None
        self.parent_run_id: str | None = None
        self.results: list[tuple[int, float]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mlflow.tracking import MlflowClient

        uri = config.tracking.uri
        self.client = MlflowClient(tracking_uri=resolve_uri(uri))
        experiment_id = get_or_create_experiment(self.client, config.tracking.experiment, uri)
        sweep_dir = str(config.hydra.sweep.dir)
        run = self.client.create_run(
            experiment_id, run_name=f"sweep-{os.path.basename(sweep_dir)}", tags={"miles.sweep_dir": sweep_dir}
        )
        self.parent_run_id = run.info.run_id
        os.environ[PARENT_RUN_ENV] = self.parent_run_id
        os.environ[SWEEP_DIR_ENV] = sweep_dir

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        value = getattr(job_return, "_return_value", None)
        if self.parent_run_id and isinstance(value, (int, float)):
            self.results.append((int(config.hydra.job.num), float(value)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.parent_run_id:
            return
        if self.results:
            best_job, best_value = max(self.results, key=lambda r: r[1])
            self.client.log_metric(self.parent_run_id, "sweep/best_objective", best_value)
            self.client.set_tag(self.parent_run_id, "miles.best_job", str(best_job))
        self.client.set_tag(self.parent_run_id, "miles.num_jobs", str(len(self.results)))
        self.client.set_terminated(self.parent_run_id)
        os.environ.pop(PARENT_RUN_ENV, None)
        os.environ.pop(SWEEP_DIR_ENV, None)
