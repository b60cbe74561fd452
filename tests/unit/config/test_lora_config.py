"""trainer.lora: the shipped defaults (off), and validate()'s refusals, each naming what to change."""

import pytest

from miles.validate import validate


FILE = ["task.kind=file", "task.train_file=prompts.jsonl"]  # records with fields (what routes to adapters)
MEGATRON = ["trainer=megatron", "hardware=h200", "hardware.gpus_per_node=1", "dry_run=true"]


def _lora(problems):
    return [p for p in problems if "lora" in p]


def test_off_by_default_and_a_lora_run_validates(compose):
    cfg = compose()
    assert cfg.trainer.lora.rank == 0 and "q_proj" in cfg.trainer.lora.target_modules
    assert validate(compose(["trainer.lora.rank=16"])) == []
    assert _lora(validate(compose(["trainer.lora.rank=8", "trainer=fsdp"]))) == []
    assert validate(compose(["trainer.lora.rank=8", *MEGATRON])) == []  # Megatron: a bf16 / fp32 base
    assert validate(compose(["trainer.lora.rank=8", *MEGATRON, "precision=int4_qat"])) == []  # and QLoRA
    assert validate(compose(["trainer.lora.rank=8", *MEGATRON, *FILE, "trainer.lora.adapters=[a,b]",
                             "trainer.lora.adapter_key=k"])) == []
    assert validate(compose(["trainer.lora.rank=8", "precision=bf16", "trainer.lora.target_modules=[q_proj,v_proj]"])) == []
    # The external engines serve the adapters with their own LoRA support (docs/lora.md).
    assert validate(compose(["trainer.lora.rank=16", "rollout=vllm"])) == []
    assert validate(compose(["trainer.lora.rank=16", "rollout=sglang"])) == []
    # Several adapters, routed by a prompt record's field; one named adapter needs no field.
    assert validate(compose(["trainer.lora.rank=16", *FILE, "trainer.lora.adapters=[add,mul]",
                             "trainer.lora.adapter_key=adapter"])) == []
    # ... with speculative rollout: each row's adapter routes the verify forwards (and the MTP draft's).
    for spec in (["model=glm4_moe_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp"],
                 ["rollout.speculative.kind=draft_model", "rollout.speculative.draft_model=qwen3_tiny_draft"]):
        assert validate(compose(["trainer.lora.rank=16", *FILE, "trainer.lora.adapters=[add,mul]",
                                 "trainer.lora.adapter_key=adapter", *spec, "rollout.speculative.train_online=false"])) == []
    assert _lora(validate(compose(["trainer.lora.rank=8", *FILE, "trainer.lora.adapters=[add,mul]",
                                   "trainer.lora.adapter_key=adapter", "trainer=fsdp"]))) == []
    assert validate(compose(["trainer.lora.rank=16", "trainer.lora.adapters=[only]"])) == []
    # PPO: a critic per adapter (miles.trainer.critic.Critics).
    assert validate(compose(["trainer.lora.rank=16", *FILE, "trainer.lora.adapters=[add,mul]",
                             "trainer.lora.adapter_key=adapter", "algo=ppo"])) == []
    for engine in ("vllm", "sglang"):  # several adapters in one batch on the external engines too
        assert validate(compose(["trainer.lora.rank=16", *FILE, "trainer.lora.adapters=[add,mul]",
                                 "trainer.lora.adapter_key=adapter", f"rollout={engine}"])) == []


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.lora.rank=-1"], "trainer.lora.rank must be >= 0"),
    (["trainer.lora.rank=8", "trainer.lora.alpha=0"], "trainer.lora.alpha must be > 0"),
    (["trainer.lora.rank=8", "trainer.lora.dropout=1.0"], "trainer.lora.dropout must be in [0, 1)"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], "target_modules must name"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[qkv_proj]"], "matches no projection of model=qwen3_tiny"),
    (["trainer.lora.rank=8", "rollout=vllm", "model=qwen3_moe_tiny"],
     "rollout=vllm serves adapters on the families qwen3, qwen2 (model family qwen3_moe is not one): use rollout=native"),
    (["trainer.lora.rank=8", "rollout=sglang", "model=qwen3_moe_tiny"], "(model family qwen3_moe is not one)"),
    (["trainer.lora.rank=600", "rollout=vllm"], "vLLM serves LoRA ranks up to 512"),
    (["trainer.lora.rank=8", "rollout=vllm", "rollout.num_gpus_per_engine=2"], "rollout.num_gpus_per_engine=1"),
    (["trainer.lora.rank=8", "rollout.weight_sync=shared_memory"], "rollout.weight_sync=object_store"),
    (["trainer.lora.rank=8", "true_on_policy=true", "trainer.lora.merge_in_engine=true"],
     "set trainer.lora.merge_in_engine=false"),
    (["trainer.lora.rank=8", "algo=sft"], "algo=sft"),
    # Several adapters (trainer.lora.adapters).
    (["trainer.lora.adapters=[a,b]", "trainer.lora.adapter_key=adapter"], "set trainer.lora.rank > 0"),
    (["trainer.lora.rank=8", *FILE, "trainer.lora.adapters=[a,b]"], "needs trainer.lora.adapter_key"),
    (["trainer.lora.rank=8", *FILE, "trainer.lora.adapters=[a,a]", "trainer.lora.adapter_key=k"],
     "names ['a'] more than once"),
    (["trainer.lora.rank=8", *FILE, "trainer.lora.adapters=[a,'x/y']", "trainer.lora.adapter_key=k"],
     "'x/y' is not a valid adapter name"),
    (["trainer.lora.rank=8", *FILE, "trainer.lora.adapters=[a,'']", "trainer.lora.adapter_key=k"],
     "'' is not a valid adapter name"),
    (["trainer.lora.rank=8", "trainer.lora.adapter_key=k"], "trainer.lora.adapters, which is empty"),
    (["trainer.lora.rank=8", "trainer.lora.adapters=[a,b]", "trainer.lora.adapter_key=k"],
     "task.kind=arithmetic has no record fields: use a prompt file"),
    # Speculative rollout routes each row's adapter (docs/lora.md); the draft's online training stays refused.
    (["trainer.lora.rank=8", *FILE, "trainer.lora.adapters=[a,b]", "trainer.lora.adapter_key=k",
      "model=glm4_moe_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp", "rollout.speculative.train_online=true"],
     "set rollout.speculative.train_online=false"),
])
def test_what_does_not_combine_is_named(compose, overrides, needle):
    problems = _lora(validate(compose(overrides)))
    assert any(needle in p for p in problems), problems
