"""Fixtures of the integration tier."""

import pytest


@pytest.fixture(scope="session")
def teacher(tmp_path_factory, compose):
    """An OPD teacher for short runs: the built-in teacher recipe (the warm-start SFT, continued) cut
    to 40 steps from the same seeded init as the test students, so far from them and from uniform."""
    from miles.orchestrate.checkpoints import warm_start_checkpoint

    cfg = compose(["task.eval_size=8", "warm_start.steps=40", "warm_start.check_interval=40",
                   "warm_start.target_accuracy=1.0", f"warm_start.cache_dir={tmp_path_factory.mktemp('teacher')}"])
    return warm_start_checkpoint(cfg, log=lambda *_: None)
