"""Runs of one feature in both arrangements: in-process (`ray.enabled=false`) and with Ray on (the
default: the engine, the trainer and the critic in Ray actors of their own). A feature that can run
both ways is tested both ways (issue 25, item 7): a check that holds for the in-process objects can
fail for a Ray actor (its class is Ray's subclass, its methods Ray's wrappers, its tensors pickled)."""

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
    """A run through miles.orchestrate.run in this process, its components in-process or Ray actors
    (a local Ray, started and shut down by the run: ~10 s more on 2 cores)."""
    if not ray:
        return run_inprocess(compose, overrides, run_dir)
    from omegaconf import OmegaConf

    from miles.orchestrate.run import run

    cfg = compose(["ray.enabled=true", *overrides])
    cfg.output_dir = str(run_dir)
    return run(cfg, run_dir, list(overrides), OmegaConf.to_yaml(OmegaConf.structured(cfg)))
