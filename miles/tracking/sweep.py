"""Hydra callback that groups a multirun under one MLflow parent run, whichever sweeper runs it.

`python launch.py -m trainer.lr=1e-4,3e-4` (basic grid sweeper) or `python launch.py -m
+sweep=tpe_lr_clip` (Optuna TPE, sweeps/sweep/) creates a parent run named after the sweep; each
job's run is its child (tag mlflow.parentRunId) and carries the tag miles.sweep_dir. At the end the
parent records the best job: `sweep/best_objective` (the value launch.py's main returns, the final
held-out accuracy), its job number, child run id and overrides, and its swept values as `best.*`
params. "Best" follows the Optuna sweeper's `direction` when one is set, else the maximum.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from miles.tracking.mlflow_logger import (PARENT_RUN_ENV, SWEEP_DIR_ENV, get_or_create_experiment, resolve_uri,
                                          seed_sqlite_store)


@dataclass
class JobResult:
    num: int
    objective: float
    overrides: list[str]
    run_dir: str


def _minimize(config: DictConfig) -> bool:
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    return str(direction).lower().endswith("minimize")  # "minimize" or Optuna's Direction.minimize


def _swept_keys(config: DictConfig) -> set[str]:
    """Keys the sweeper varies (hydra.sweeper.params and command-line sweeps such as `a=1,2` or
    `a=interval(0,1)`), to log the best job's values of them as params."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params", default=None) or {}
    texts = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    return {o.get_key_element() for o in OverridesParser.create().parse_overrides(texts) if o.is_sweep_override()}


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.client = None
        self.parent_run_id: str | None = None
        self.results: list[JobResult] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from mlflow.tracking import MlflowClient

        uri = config.tracking.uri
        seed_sqlite_store(resolve_uri(uri))
        self.client = MlflowClient(tracking_uri=resolve_uri(uri))
        experiment_id = get_or_create_experiment(self.client, config.tracking.experiment, uri)
        sweep_dir = str(config.hydra.sweep.dir)
        name = OmegaConf.select(config, "hydra.runtime.choices.sweep", default=None)
        sweeper = str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).rsplit(".", 1)[-1]
        run = self.client.create_run(
            experiment_id,
            run_name=f"sweep-{name + '-' if name else ''}{os.path.basename(sweep_dir)}",
            tags={"miles.sweep_dir": sweep_dir, "miles.sweeper": sweeper},
        )
        self.parent_run_id = run.info.run_id
        os.environ[PARENT_RUN_ENV] = self.parent_run_id
        os.environ[SWEEP_DIR_ENV] = sweep_dir

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        value = getattr(job_return, "_return_value", None)  # unset when the job raised
        if self.parent_run_id and isinstance(value, (int, float)):
            self.results.append(JobResult(
                int(config.hydra.job.num), float(value), list(config.hydra.overrides.task),
                str(config.hydra.runtime.output_dir),
            ))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if not self.parent_run_id:
            return
        os.environ.pop(PARENT_RUN_ENV, None)
        os.environ.pop(SWEEP_DIR_ENV, None)
        best = None
        if self.results:
            best = (min if _minimize(config) else max)(self.results, key=lambda r: r.objective)
            print(f"sweep: best of {len(self.results)} jobs is job {best.num} (objective {best.objective:.4f}): "
                  f"{' '.join(best.overrides)}")
        try:
            if best:
                self._record_best(best, _swept_keys(config))
            self.client.set_tag(self.parent_run_id, "miles.num_jobs", str(len(self.results)))
            self.client.set_terminated(self.parent_run_id)
        except Exception as ex:  # noqa: BLE001  the jobs are done and logged; only the summary is lost
            print(f"warning: the sweep's parent run {self.parent_run_id} was not updated: {ex}", file=sys.stderr)

    def _record_best(self, best: JobResult, swept: set[str]) -> None:
        from mlflow.entities import Param

        run_id = self.parent_run_id
        self.client.log_metric(run_id, "sweep/best_objective", best.objective)
        self.client.set_tag(run_id, "miles.best_job", str(best.num))
        self.client.set_tag(run_id, "miles.best_overrides", " ".join(best.overrides))
        child = self.client.search_runs(
            [self.client.get_run(run_id).info.experiment_id],
            filter_string=f"tags.mlflow.parentRunId = '{run_id}' and tags.`miles.run_dir` = '{best.run_dir}'",
        )
        if child:
            self.client.set_tag(run_id, "miles.best_run_id", child[0].info.run_id)
        values = dict(o.split("=", 1) for o in best.overrides if "=" in o)
        params = [Param(f"best.{k}", values[k]) for k in sorted(swept) if k in values]
        if params:
            self.client.log_batch(run_id, params=params)
