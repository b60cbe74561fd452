"""trainer.lora.merge_in_engine: valid with one adapter on the native engine, refused otherwise with
a message naming the key to change (exit 2 through launch.py, as every validate() problem); the
tensor-by-tensor sync check, which has no adapters to compare, refused with LoRA."""

import pytest

from miles.validate import validate

FILE = ["task.kind=file", "task.train_file=prompts.jsonl"]


def test_one_adapter_merged_in_the_native_engine_validates(compose):
    assert compose().trainer.lora.merge_in_engine is False
    assert validate(compose(["trainer.lora.rank=16", "trainer.lora.merge_in_engine=true"])) == []
    assert validate(compose(["trainer.lora.rank=16", "trainer.lora.merge_in_engine=true", "trainer=fsdp"])) == []


@pytest.mark.parametrize("overrides, needle", [
    (["trainer.lora.merge_in_engine=true"], "set trainer.lora.rank > 0"),
    (["trainer.lora.rank=8", "trainer.lora.merge_in_engine=true", *FILE, "trainer.lora.adapters=[add,mul]",
      "trainer.lora.adapter_key=adapter"], "cannot hold them all merged: set trainer.lora.merge_in_engine=false"),
    (["trainer.lora.rank=8", "debug.compare_weights_tensorwise=true"], "set debug.compare_weights_tensorwise=false"),
    (["trainer.lora.rank=8", "trainer.lora.merge_in_engine=true", "rollout=vllm"],
     "rollout=vllm applies adapters its own way: set trainer.lora.merge_in_engine=false or rollout=native"),
])
def test_refusals_name_the_key(compose, overrides, needle):
    problems = validate(compose(overrides))
    assert any(needle in p for p in problems), problems
