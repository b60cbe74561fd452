"""rollout.speculative: each setting the speculative decoder or its online training cannot honour is
refused by validate(), naming the key to change; the supported ones pass."""

import pytest

from miles.validate import validate

DRAFT = ["rollout.speculative.kind=draft_model", "rollout.speculative.draft_model=qwen3_tiny_draft"]


@pytest.mark.parametrize("overrides", [
    DRAFT,
    [*DRAFT, "rollout.speculative.train_online=false", "rollout.num_engines=2"],
    ["model=glm4_moe_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp", "rollout.speculative.num_tokens=5"],
    ["model=qwen3_next_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp", "rollout.asynchronous=true"],
])
def test_supported_settings_pass(compose, overrides):
    assert validate(compose(overrides)) == []


@pytest.mark.parametrize("overrides, message", [
    (["rollout.speculative.kind=mtp"], "set model.mtp_layers=1"),
    (["rollout.speculative.kind=draft_model"], "needs rollout.speculative.draft_model"),
    ([*DRAFT, "rollout.speculative.num_tokens=0"], "rollout.speculative.num_tokens must be >= 1 (got 0)"),
    ([*DRAFT, "rollout.speculative.lr=0"], "rollout.speculative.lr must be > 0"),
    ([*DRAFT, "rollout=vllm"], "rollout=vllm has its own speculative options (rollout.vllm.llm_args)"),
    ([*DRAFT, "true_on_policy=true"], "set rollout.speculative.kind=none with algo.routing_replay=r3"),
    (["model=glm4_moe_tiny", "model.mtp_layers=1", "rollout.speculative.kind=mtp", "rollout.slot_decode=true"],
     "kind=mtp decodes on the padded path"),
    ([*DRAFT, "trainer=fsdp", "trainer.num_ranks=2"], "set trainer=torch or rollout.speculative.train_online=false"),
    ([*DRAFT, "rollout.asynchronous=true"], "set rollout.asynchronous=false and rollout.weight_sync=object_store"),
    (["model=qwen3_tiny", "model.mtp_layers=1"], "mtp_layers"),
])
def test_unsupported_settings_are_refused_naming_the_key(compose, overrides, message):
    problems = validate(compose(overrides))
    assert any(message in p for p in problems), problems
