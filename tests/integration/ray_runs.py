"""Runs of one feature in both arrangements: in-process (`ray.enabled=false`) and with Ray on (the
default: the engine, the trainer and the critic in Ray actors of their own). A feature that can run
both ways is tested both ways (issue 25, item 7): a check that holds for the in-process objects can
fail for a Ray actor (its class is Ray's subclass, its methods Ray's wrappers, its tensors pickled)."""

import contextlib

import pytest

from runs import run_inprocess

# Parametrise a test over both; the test takes `ray` (bool). Under xdist the in_process case runs
# outside the Ray group (tests/conftest.py).
WITH_AND_WITHOUT_RAY = pytest.mark.parametrize("ray", [False, True], ids=["in_process", "ray"])
# The same with the Ray case in the extended tier (make test-extended): for a feature whose Ray
# arrangement another test of make test runs already.
WITH_AND_WITHOUT_RAY_EXTENDED = pytest.mark.parametrize(
    "ray", [False, pytest.param(True, marks=pytest.mark.extended)], ids=["in_process", "ray"])


def run_with(compose, overrides, run_dir, ray: bool):
    """A run through miles.orchestrate.run in this process, its components in-process or Ray actors.
    With Ray on: a local Ray that the run starts and shuts down (~4-5 s of start and stop on 2 cores),
    or, where the test module holds one (tests/conftest.py `ray_connection`: a test with several Ray
    runs or a module of them), that Ray, kept for the next run: the run's actors are killed after it
    instead of its ray.shutdown (`on_this_ray`)."""
    if not ray:
        return run_inprocess(compose, overrides, run_dir)
    import ray as ray_module
    from omegaconf import OmegaConf

    from miles.orchestrate.run import run

    cfg = compose(["ray.enabled=true", *overrides])
    cfg.output_dir = str(run_dir)
    args = (cfg, run_dir, list(overrides), OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    if not ray_module.is_initialized():
        return run(*args)
    assert not cfg.deterministic, "a deterministic run sets its workers' runtime_env when it starts Ray"
    assert cfg.trainer.backend.value != "fsdp", "FSDP's rank actors are not spawned through run.spawn"
    with on_this_ray():
        return run(*args)


@contextlib.contextmanager
def on_this_ray():
    """A run on the Ray already up in this process: its ray.shutdown does nothing, and every actor it
    spawned (miles.orchestrate.run.spawn: the engines, the trainer, the critic; an engine a fleet
    restarted is its handle's current actor) is killed when it ends, so the next run finds the CPUs
    free. FSDP's rank actors (miles.trainer.fsdp_group) are not spawned there: not for FSDP runs."""
    import ray

    import miles.orchestrate.run as run_module

    spawned, spawn, shutdown = [], run_module.spawn, ray.shutdown

    def recording(cls, *args, **kwargs):
        handle = spawn(cls, *args, **kwargs)
        spawned.append(handle)
        return handle

    run_module.spawn, ray.shutdown = recording, lambda *args, **kwargs: None
    try:
        yield
    finally:
        run_module.spawn, ray.shutdown = spawn, shutdown
        for handle in spawned:
            if not handle.in_process:
                ray.kill(handle.actor, no_restart=True)
