"""Registers the schema in Hydra's ConfigStore: `conf/config.yaml` lists `run_schema` first, so every
group file is merged into its typed node (unknown keys and wrong types fail at composition)."""

from hydra.core.config_store import ConfigStore

from miles.config.schema import RunCfg


def register_configs() -> None:
    ConfigStore.instance().store(name="run_schema", node=RunCfg)
