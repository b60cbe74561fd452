"""Every problem of a run's config, found before anything starts and reported at once.

    problems = validate(cfg)   # [] when the run may start; each message names the key to change
    check(cfg)                 # raises ConfigError holding them all (launch.py: one message, exit 2)

The config's own cross-field rules are miles/config/rules.py. A rule that needs what a component
knows (the families Megatron maps, the tools that resolve, the adapters vLLM and SGLang serve), and
each backend's own rules (what vLLM, SGLang, FSDP, Megatron combine with), live in that component's
module, and this module, above both, runs them after the config's: miles/config imports nothing above
itself. A new component or backend with rules of its own adds them to COMPONENT_RULES.
"""

from __future__ import annotations

from miles.config.errors import ConfigError
from miles.config.rules import config_problems
from miles.config.schema import RunCfg
from miles.rollout.sglang_lora import sglang_lora_problems
from miles.rollout.sglang_rules import sglang_problems
from miles.rollout.tools import tool_problems
from miles.rollout.vllm_lora import vllm_lora_problems
from miles.rollout.vllm_rules import vllm_problems
from miles.trainer.fsdp_rules import fsdp_problems
from miles.trainer.megatron.rules import megatron_problems

# Each returns [] for a run it does not concern (another backend, no LoRA, no tools).
COMPONENT_RULES = (tool_problems, vllm_problems, vllm_lora_problems, sglang_problems, sglang_lora_problems,
                   fsdp_problems, megatron_problems)


def validate(cfg: RunCfg) -> list[str]:
    return config_problems(cfg) + [problem for rule in COMPONENT_RULES for problem in rule(cfg)]


def check(cfg: RunCfg) -> None:
    if problems := validate(cfg):
        raise ConfigError(problems)
