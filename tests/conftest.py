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


# One local Ray for the whole session, joined by the tests that run Ray actors (each module, contract
# and run connects as a job of its own and disconnects after, as it did with a Ray of its own): a Ray
# start costs ~10 s on 2 cores (~17 s loaded), and the suite started ~25. A helper process starts it
# with ray.init (which, unlike `ray start`, writes no /tmp/ray/ray_current_cluster that a plain
# ray.init() elsewhere would join) and ends it when pytest exits (its stdin closes). The runs that test
# Ray's start by the run itself (launch.py's default local Ray, the fault tests that kill its actors,
# `ray.address=auto`) still start their own.
_RAY_HOLDER = r"""
import logging, select, sys, time
import ray
ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, logging_level=logging.WARNING)
node = ray._private.worker._global_node
print(node.gcs_address, flush=True)
while node.remaining_processes_alive():  # `ray stop --force` (test_existing_ray_cluster) kills it
    if select.select([sys.stdin], [], [], 0.5)[0] and not sys.stdin.read(1):
        break  # pytest is gone
ray.shutdown()
"""
SHARED_RAY_CPUS = 4  # the most any test asks for at once: 2 FSDP ranks + 2 engines (test_scale_out_runs)


class SharedRay:
    """address(): the GCS address of the session's Ray, (re)started if it is not running."""

    def __init__(self, cwd: Path):
        self.cwd, self.proc, self._address = cwd, None, None

    def _alive(self) -> bool:
        import socket

        if self.proc is None or self.proc.poll() is not None:
            return False
        host, port = self._address.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError:  # its GCS is gone (`ray stop --force`), the holder about to notice
            return False
        return True

    def address(self) -> str:
        if not self._alive():
            self.stop()
            # No token auth on this local test cluster: the drivers that join it start with Ray's defaults.
            env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
            self.proc = subprocess.Popen([sys.executable, "-c", _RAY_HOLDER, str(SHARED_RAY_CPUS)], cwd=self.cwd,
                                         env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._address = self.proc.stdout.readline().strip()
            if not self._address:
                raise RuntimeError("the shared Ray did not start")
        return self._address

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory):
    """The session's Ray (SharedRay): connect with ray.init(address=shared_ray.address()) or run with
    ray.address=<it>; ray.shutdown() then disconnects, and Ray ends the job's actors."""
    holder = SharedRay(tmp_path_factory.mktemp("shared_ray"))
    yield holder
    holder.stop()


@pytest.fixture(scope="module")
def ray_connection(shared_ray):
    """A module's connection to the session's Ray (instead of a Ray of its own per module)."""
    import logging

    import ray

    ray.init(address=shared_ray.address(), logging_level=logging.WARNING)
    yield
    ray.shutdown()
