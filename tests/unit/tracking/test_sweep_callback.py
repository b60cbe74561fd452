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
