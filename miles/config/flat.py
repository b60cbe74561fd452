"""A config as flat `section.key` -> string pairs: MLflow's params, and what a checkpoint or a saved
rollout batch records of the config that made it (compared again when it is read back)."""

from __future__ import annotations

from dataclasses import asdict
from enum import Enum

from miles.config.schema import RunCfg

MAX_VALUE_LEN = 6000  # MLflow's limit on a param value; checkpoints store the same strings


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    flat = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(flatten(v, key + "."))
        else:
            flat[key] = str(v.value if isinstance(v, Enum) else v)[:MAX_VALUE_LEN]
    return flat


def flat_config(cfg: RunCfg) -> dict[str, str]:
    return flatten(asdict(cfg))
