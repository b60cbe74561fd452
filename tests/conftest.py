"""Shared fixtures. Tests run on CPU with tiny models the code builds; nothing is downloaded."""

from pathlib import Path

import pytest

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
