"""Shared fixtures. Tests run on CPU with tiny models the code builds; nothing is downloaded."""

import importlib.metadata
import os
import subprocess
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


# A local Ray of a test's own (`own_ray`) or of a module's own (`module_ray_cluster`, `ray_connection`), never
# one shared by the whole session: a session Ray saved ~10 s per start, but jobs that joined it after
# other jobs had their actors cancelled before they started (an unexplained Ray state; the CI run of
# 2026-12-04 failed 56 tests that way), so each user starts from a fresh one as before. A helper
# process starts it with ray.init(address="local") (a new Ray, never one found running on the
# machine: another test worker's, a `ray start`; unlike `ray start`, it writes no
# /tmp/ray/ray_current_cluster that a plain ray.init() elsewhere would join) and ends it when asked
# or when pytest exits (its stdin closes).
_RAY_HOLDER = r"""
import logging, select, sys
import ray
ray.init(address="local", num_cpus=int(sys.argv[1]), include_dashboard=False, logging_level=logging.WARNING)
node = ray._private.worker._global_node
print(node.gcs_address, flush=True)
while node.remaining_processes_alive():
    if select.select([sys.stdin], [], [], 0.5)[0] and not sys.stdin.read(1):
        break  # stopped, or pytest is gone
ray.shutdown()
"""
RAY_CPUS = 4  # the most any test asks for at once: 2 FSDP ranks + 2 engines (test_scale_out_runs)


class LocalRay:
    """A local Ray in a helper process: address() for ray.init(address=...) or ray.address=<it>
    (ray.shutdown() there only disconnects; Ray ends that job's actors), stop() ends it."""

    def __init__(self, cwd: Path):
        # No token auth on this local test cluster: the drivers that join it start with Ray's defaults.
        env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
        self.proc = subprocess.Popen([sys.executable, "-c", _RAY_HOLDER, str(RAY_CPUS)], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._address = self.proc.stdout.readline().strip()
        if not self._address:
            self.stop()
            raise RuntimeError("the test's local Ray did not start")

    def address(self) -> str:
        return self._address

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def own_ray(tmp_path_factory):
    """A Ray for this test alone (LocalRay): runs join it with ray.address=own_ray.address()."""
    ray_ = LocalRay(tmp_path_factory.mktemp("ray"))
    yield ray_
    ray_.stop()


@pytest.fixture(scope="module")
def module_ray_cluster(tmp_path_factory):
    """A Ray for this module's tests (LocalRay)."""
    ray_ = LocalRay(tmp_path_factory.mktemp("ray"))
    yield ray_
    ray_.stop()


@pytest.fixture(scope="module")
def ray_connection(module_ray_cluster):
    """This process connected to the module's Ray for the module's tests."""
    import logging

    import ray

    ray.init(address=module_ray_cluster.address(), logging_level=logging.WARNING)
    yield
    ray.shutdown()
