"""trainer.lora with the quantized precision recipes (QLoRA, docs/lora.md): what validates, and each
refusal naming the key to change."""

import pytest

from miles.validate import validate


def _lora(problems):
    return [p for p in problems if "lora" in p]


@pytest.mark.parametrize("recipe", ["fp8", "int4_qat", "bf16_train_fp8_rollout", "bf16_train_int4_rollout"])
def test_every_quantized_recipe_validates_with_lora(compose, recipe):
    assert validate(compose(["trainer.lora.rank=8", f"precision={recipe}"])) == []
    assert validate(compose(["trainer.lora.rank=8", f"precision={recipe}", "algo.kl_coef=0.1",
                             "trainer.lora.target_modules=[q_proj,v_proj]"])) == []


@pytest.mark.parametrize("overrides, message", [
    (["precision=fp8", "trainer.lora.merge_in_engine=true"],
     "trainer.lora.merge_in_engine=true with precision=fp8: the engine holds the base quantized (fp8), which cannot "
     "hold W + alpha / rank * B A exactly (each sync would round the sum to the quantized grid): set "
     "trainer.lora.merge_in_engine=false (the adapters applied unmerged)"),
    (["precision=bf16_train_int4_rollout", "trainer.lora.merge_in_engine=true"],
     "trainer.lora.merge_in_engine=true with precision=bf16_train_int4_rollout: the engine holds the base quantized "
     "(int4), which cannot hold W + alpha / rank * B A exactly (each sync would round the sum to the quantized grid): "
     "set trainer.lora.merge_in_engine=false (the adapters applied unmerged)"),
    (["precision=fp8", "precision.train_quant=int4"],
     "trainer.lora.rank=8 with precision.train_quant=int4: the trainer holds the frozen base in the rollout's format, "
     "precision.rollout_quant=fp8: set precision.train_quant=fp8 (or precision=fp8 / int4_qat)"),
    (["precision=int4_qat", "precision.forward_weights=rollout"],
     "trainer.lora.rank=8 with precision.forward_weights=rollout is not built yet (LoRA holds the frozen base once, as "
     "the default forward reads it): set precision.forward_weights=master"),
])
def test_what_does_not_combine_is_named(compose, overrides, message):
    assert _lora(validate(compose(["trainer.lora.rank=8", *overrides]))) == [message]


def test_merge_in_engine_still_validates_over_a_dense_base(compose):
    assert validate(compose(["trainer.lora.rank=8", "precision=bf16", "trainer.lora.merge_in_engine=true"])) == []


@pytest.mark.parametrize("recipe", ["fp8", "int4_qat"])
def test_fsdp_holds_the_quantized_base_with_lora_only(compose, recipe):
    """trainer=fsdp runs QLoRA (the frozen base held quantized on its ranks, miles/trainer/fsdp_qlora.py),
    not fake-quantized full training (miles/trainer/fsdp_rules.py): that refusal names trainer=torch."""
    assert validate(compose(["trainer.lora.rank=8", f"precision={recipe}", "trainer=fsdp", "ray.enabled=true"])) == []
    problems = validate(compose([f"precision={recipe}", "trainer=fsdp", "ray.enabled=true"]))
    assert problems == [f"trainer=fsdp does not support precision={recipe} (fake-quantized training without "
                        "trainer.lora) yet: use trainer=torch"]
