"""The rollout engines by name: `rollout=<name>` (an `EngineName`) -> the engine's class and its options.

    cls, options = engine_backend(cfg.rollout)   # NativeEngine, {} / VLLMEngine, asdict(cfg.rollout.vllm)
    handle = spawn(cls, use_ray, checkpoint_dir, cfg.rollout, ..., **options)

A lazy registry: an engine's module is imported when its class is asked for, never by naming it here
(vLLM and SGLang are optional dependencies). An engine's options are the block its group file adds,
`rollout.<name>` (conf/rollout/<name>.yaml; the native engine has none): miles/config/rules.py
`engine_problems` checks that only the chosen engine's block is present.

A new engine: its class (the RolloutEngine protocol of miles/rollout/protocol.py, tests/engine_contract.py),
its name in `EngineName`, its group file, its rules module registered in miles/validate.py, and one
entry below.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict

from miles.config.schema import EngineName, RolloutCfg

ENGINES = {
    EngineName.native: ("miles.rollout.native", "NativeEngine"),
    EngineName.vllm: ("miles.rollout.vllm_engine", "VLLMEngine"),
    EngineName.sglang: ("miles.rollout.sglang_engine", "SGLangEngine"),
}


def engine_class(name: EngineName) -> type:
    module, cls = ENGINES[name]
    return getattr(importlib.import_module(module), cls)


def engine_backend(rollout: RolloutCfg) -> tuple[type, dict]:
    """The class of `rollout.engine` and the keyword arguments of its own options block."""
    options = getattr(rollout, rollout.engine.value, None)
    return engine_class(rollout.engine), asdict(options) if options is not None else {}
