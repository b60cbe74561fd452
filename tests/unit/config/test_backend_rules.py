"""Each backend's own rules live with the backend (miles/rollout/vllm_rules.py, sglang_rules.py,
miles/trainer/fsdp_rules.py, megatron/rules.py) and miles/validate.py runs them: a rule fires from its
backend's module and nowhere else, concerns only its backend, and the config's own rules
(miles/config/rules.py) name no external backend."""

import ast
import re
from pathlib import Path

import pytest

from miles.config.rules import config_problems
from miles.rollout.sglang_rules import sglang_problems
from miles.rollout.vllm_rules import vllm_problems
from miles.trainer.fsdp_rules import fsdp_problems
from miles.trainer.megatron.rules import megatron_problems
from miles.validate import COMPONENT_RULES, validate

RULES = Path(__file__).resolve().parents[3] / "miles" / "config" / "rules.py"
BACKEND_RULES = (vllm_problems, sglang_problems, fsdp_problems, megatron_problems)


def test_every_backend_rules_module_is_run_by_validate():
    assert set(BACKEND_RULES) <= set(COMPONENT_RULES)
    assert len(set(COMPONENT_RULES)) == len(COMPONENT_RULES)  # each runs once: no message twice


@pytest.mark.parametrize("overrides, rule, message", [
    (["rollout=vllm", "rollout.top_k=5"], vllm_problems, "set rollout.top_k=0 and rollout.top_p=1.0"),
    (["rollout=vllm", "rollout.vllm.kv_cache_gb=0"], vllm_problems, "rollout.vllm.kv_cache_gb must be > 0 (got 0.0)"),
    (["rollout=vllm", "rollout.speculative.kind=mtp", "model.mtp_layers=1"], vllm_problems,
     "rollout=vllm has its own speculative options (rollout.vllm.llm_args): set rollout.speculative.kind=none"),
    (["rollout=sglang", "rollout.sglang.url=http://h:1", "rollout.num_engines=2"], sglang_problems,
     "set rollout.sglang.url=null or rollout.num_engines=1"),
    (["rollout=sglang", "rollout.speculative.kind=mtp", "model.mtp_layers=1"], sglang_problems,
     "rollout=sglang has its own speculative options (rollout.sglang.server_args)"),
    (["trainer=fsdp", "ray.enabled=false"], fsdp_problems, "trainer=fsdp runs its ranks as Ray actors"),
    (["trainer=fsdp", "rollout.weight_sync=broadcast"], fsdp_problems, "not FSDP ranks yet: set rollout.weight_sync"),
    (["trainer=fsdp", "trainer.offload=true"], fsdp_problems, "trainer.offload=true with trainer=fsdp is not supported"),
    (["trainer.num_ranks=2"], fsdp_problems, "trainer.num_ranks > 1 with trainer=torch is not supported: use trainer=fsdp"),
])
def test_a_backend_rule_fires_from_its_own_module_only(compose, overrides, rule, message):
    cfg = compose(overrides)
    assert [p for p in rule(cfg) if message in p], rule(cfg)
    assert not [p for p in config_problems(cfg) if message in p]
    assert len([p for p in validate(cfg) if message in p]) == 1


@pytest.mark.parametrize("rule", BACKEND_RULES, ids=lambda rule: rule.__name__)
def test_a_backend_rule_leaves_other_backends_alone(compose, rule):
    """What each rule refuses on its own backend, set on the default run (native engine, torch trainer)."""
    cfg = compose(["rollout.top_k=5", "precision=bf16_train_fp8_rollout", "rollout.weight_sync=broadcast",
                   "debug.compare_weights_tensorwise=true", "ray.enabled=false"])
    assert rule(cfg) == []


def test_a_hand_chosen_engine_gets_the_choice_message_only(compose):
    """rollout.engine=vllm without its group: no rollout.vllm block for vLLM's rules to read."""
    assert validate(compose(["rollout.engine=vllm"])) == [
        "rollout.engine=vllm with options rollout.<none>: choose the engine with its group, rollout=vllm "
        "(conf/rollout/vllm.yaml adds its options)"]


def test_the_configs_rules_name_no_external_backend():
    tree = ast.parse(RULES.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef)) and ast.get_docstring(n) is not None}
    code = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docstrings]
    code += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    code += [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    assert not [c for c in code if re.search("vllm|sglang|fsdp|megatron", c, re.IGNORECASE)]
