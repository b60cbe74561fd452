"""Shared fixtures. Tests run on CPU with tiny models the code builds; nothing is downloaded."""

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

# OpenMP threads that wait sleep instead of spinning, in this process and every process it starts (launch.py
# runs, Ray's workers): torch's 2 threads per component spin-wait in each parallel region, and on 2 cores
# shared with another process (a Ray actor, the MLflow server, a second test run) a tiny model's step
# then took 4-14 s instead of 0.2-1.3 s (measured: a 6-step launch.py run 125-142 s -> 55-89 s under load,
# the same metrics). Same threads, same kernels, same numbers: only how an idle thread waits. It must be
# set before torch loads its OpenMP runtime; an OMP_WAIT_POLICY of the caller's is kept. Not in the vLLM
# tier's environment (.venv-vllm), whose CPU backend manages its OpenMP threads itself.
if "torch" not in sys.modules and "vllm" not in importlib.metadata.packages_distributions():
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


@pytest.fixture(scope="session")
def compose():
    """compose(overrides) -> typed RunCfg, through the same ConfigStore schema launch.py uses."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from miles.config.store import register_configs

    register_configs()

    def _compose(overrides=()):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            dcfg = hydra_compose("config", overrides=list(overrides))
        return OmegaConf.to_object(dcfg)

    return _compose


# Each Ray test module starts a local Ray in this process (`ray_connection`), and each Ray run through
# run_with / launch.py starts its own: never one Ray shared by the session or joined from another
# process. Both of those were tried (2026-12-04) and CI failed 56 Ray tests each time with "the actor
# never ran - it was cancelled before it started", after the external-cluster tests had run; this
# arrangement passed every CI run before them. address="local" starts a new Ray even where one runs on
# the machine (a `ray start` of the external-cluster tests, which `make test` runs in a pass of their own).
RAY_CPUS = 4  # the most any test asks for at once: 2 FSDP ranks + 2 engines (test_scale_out_runs)


@pytest.fixture(scope="module")
def ray_connection():
    """A local Ray in this process for the module's tests."""
    import logging

    import ray

    ray.init(address="local", num_cpus=RAY_CPUS, include_dashboard=False, logging_level=logging.WARNING)
    yield
    ray.shutdown()
