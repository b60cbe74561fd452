"""trainer.lora: the shipped defaults (off), and validate()'s refusals, each naming what to change."""

import pytest

from miles.validate import validate


def _lora(problems):
    return [p for p in problems if "lora" in p]


def test_off_by_default_and_a_lora_run_validates(compose):
    cfg = compose()
    assert cfg.trainer.lora.rank == 0 and "q_proj" in cfg.trainer.lora.target_modules
    assert validate(compose(["trainer.lora.rank=16"])) == []
    assert _lora(validate(compose(["trainer.lora.rank=8", "trainer=fsdp"]))) == []
    assert validate(compose(["trainer.lora.rank=8", "precision=bf16", "trainer.lora.target_modules=[q_proj,v_proj]"])) == []
    # The external engines serve the adapters with their own LoRA support (docs/lora.md).
    assert validate(compose(["trainer.lora.rank=16", "rollout=vllm"])) == []
    assert validate(compose(["trainer.lora.rank=16", "rollout=sglang"])) == []


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.lora.rank=-1"], "trainer.lora.rank must be >= 0"),
    (["trainer.lora.rank=8", "trainer.lora.alpha=0"], "trainer.lora.alpha must be > 0"),
    (["trainer.lora.rank=8", "trainer.lora.dropout=1.0"], "trainer.lora.dropout must be in [0, 1)"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[]"], "target_modules must name"),
    (["trainer.lora.rank=8", "trainer.lora.target_modules=[qkv_proj]"], "matches no projection of model=qwen3_tiny"),
    (["trainer.lora.rank=8", "trainer=megatron"], "Transformer Engine"),
    (["trainer.lora.rank=8", "rollout=vllm", "model=qwen3_moe_tiny"],
     "rollout=vllm serves adapters on the families qwen3, qwen2 (model family qwen3_moe is not one): use rollout=native"),
    (["trainer.lora.rank=8", "rollout=sglang", "model=qwen3_moe_tiny"], "(model family qwen3_moe is not one)"),
    (["trainer.lora.rank=600", "rollout=vllm"], "vLLM serves LoRA ranks up to 512"),
    (["trainer.lora.rank=8", "rollout=vllm", "rollout.num_gpus_per_engine=2"], "rollout.num_gpus_per_engine=1"),
    (["trainer.lora.rank=8", "rollout.weight_sync=shared_memory"], "rollout.weight_sync=object_store"),
    (["trainer.lora.rank=8", "precision=fp8"], "QLoRA"),
    (["trainer.lora.rank=8", "true_on_policy=true"], "true_on_policy=false"),
    (["trainer.lora.rank=8", "algo=sft"], "algo=sft"),
])
def test_what_does_not_combine_is_named(compose, overrides, needle):
    problems = _lora(validate(compose(overrides)))
    assert any(needle in p for p in problems), problems
