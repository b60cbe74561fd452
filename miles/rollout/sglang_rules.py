"""What `rollout=sglang` (miles/rollout/sglang_engine.py) combines with, checked before anything starts
(miles/validate.py runs it with the config's own rules). Pure: no sglang import, so any machine validates
an SGLang run's config. Its adapters' rules are miles/rollout/sglang_lora.py `sglang_lora_problems`."""

from __future__ import annotations

from miles.config.rules import engine_chosen_by_group
from miles.config.schema import EngineName, RunCfg, SpeculativeKind


def sglang_problems(cfg: RunCfg) -> list[str]:
    if cfg.rollout.engine != EngineName.sglang:
        return []
    # Without its group's rollout.sglang block the config's engine_problems says how to choose the engine.
    problems = _server_problems(cfg) if engine_chosen_by_group(cfg.rollout) else []
    if cfg.rollout.speculative.kind != SpeculativeKind.none:
        problems.append("rollout.speculative runs in the native engine; rollout=sglang has its own speculative "
                        "options (rollout.sglang.server_args): set rollout.speculative.kind=none")
    return problems


def _server_problems(cfg: RunCfg) -> list[str]:
    """The server's options."""
    r, s = cfg.rollout, cfg.rollout.sglang
    problems = []
    if cfg.precision.rollout_quant.value != "none":
        problems.append(f"rollout=sglang quantizes with SGLang's own kernels, not precision={cfg.precision.name}'s "
                        "rollout format: use precision=bf16 and rollout.sglang.server_args.quantization")
    if r.num_engines > 1 and s.url:
        problems.append("rollout.sglang.url is one server; rollout.num_engines > 1 launches one per engine: "
                        "set rollout.sglang.url=null or rollout.num_engines=1")
    if "max_running_requests" in s.server_args:
        problems.append("rollout.sglang.server_args.max_running_requests is rollout.max_running (one key for every "
                        f"engine): set rollout.max_running={s.server_args['max_running_requests']} and drop it from "
                        "server_args")
    return problems
