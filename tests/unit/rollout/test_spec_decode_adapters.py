"""Speculative decoding with several LoRA adapters (trainer.lora.adapters) in the native engine: each
live row's adapter follows it through the draft-and-verify decoders (the padded one, spec_decode.py,
with a draft model or the model's MTP module, and the slot one, spec_slots.py, here without CUDA
graphs), through compaction, stop tokens and chunks, so greedy speculative decoding gives the
non-speculative multi-adapter decode's tokens for every row, with its log-probs (fp32).

The two adapters differ (random A and B, B non-zero) and change the greedy responses: a test below
checks that swapping the prompts' adapters changes them, so a dropped or reversed route fails.
"""

from dataclasses import replace

import pytest
import torch

from miles.config.schema import LoRACfg, RolloutCfg, SpeculativeCfg
from miles.rollout.native import NativeEngine

from test_spec_decode import PROMPTS, checkpoint  # noqa: F401  (the module's checkpoint fixture)

TWO = LoRACfg(rank=4, alpha=8.0, adapters=["add", "mul"], adapter_key="adapter")
ROUTE = [0, 1, 1, 0]  # one adapter per prompt of PROMPTS


def adapter_weights(engine: NativeEngine, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random A and B for both adapters (B non-zero: the adapters change the outputs)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=gen) * 0.5 for name, t in engine.lora.tensors().items()}


def engines(target: str, kind: str, k: int, draft: str | None = None, slots: bool = False, **rollout):
    """(plain engine, speculative engine), both holding the same two differing adapters."""
    cfg = RolloutCfg(max_new_tokens=24, **rollout)
    spec_cfg = replace(cfg, speculative=SpeculativeCfg(kind=kind, num_tokens=k), slot_decode=True if slots else None)
    plain = NativeEngine(target, cfg, lora=TWO)
    spec = NativeEngine(target, spec_cfg, draft_dir=draft, lora=TWO)
    weights = adapter_weights(plain)
    plain.lora.load(weights)
    spec.lora.load(weights)
    return plain, spec


def assert_same_greedy(plain, spec, n: int = 2, route=ROUTE) -> list:
    a = plain.generate(PROMPTS, PROMPTS, n=n, temperature=0.0, adapters=route)
    b = spec.generate(PROMPTS, PROMPTS, n=n, temperature=0.0, adapters=route)
    for x, y in zip(a, b):
        assert y.adapter == x.adapter
        assert y.response_ids == x.response_ids and y.finish_reason == x.finish_reason
        torch.testing.assert_close(torch.tensor(y.rollout_logprobs), torch.tensor(x.rollout_logprobs),
                                   atol=2e-5, rtol=0)
    return b


def test_the_adapters_change_the_greedy_responses(checkpoint):  # noqa: F811
    plain, _ = engines(checkpoint("qwen3_tiny"), "draft_model", 3, checkpoint("qwen3_tiny", seed=2))
    a = plain.generate(PROMPTS, PROMPTS, n=1, temperature=0.0, adapters=ROUTE)
    b = plain.generate(PROMPTS, PROMPTS, n=1, temperature=0.0, adapters=[1 - i for i in ROUTE])
    assert all(x.response_ids != y.response_ids for x, y in zip(a, b))


@pytest.mark.parametrize("slots", [False, True], ids=["padded", "slots"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_draft_model_equals_the_routed_plain_greedy(checkpoint, k, slots):  # noqa: F811
    # Stop tokens end rows inside verify steps: finished rows are compacted away with their adapters.
    plain, spec = engines(checkpoint("qwen3_tiny"), "draft_model", k, checkpoint("qwen3_tiny", seed=2), slots,
                          stop_tokens=["1", "="])
    samples = assert_same_greedy(plain, spec, n=3)
    assert any(s.finish_reason.value == "stop" for s in samples)
    assert any(s.finish_reason.value != "stop" for s in samples)


def test_slots_route_each_chunk(checkpoint):  # noqa: F811
    plain, spec = engines(checkpoint("qwen3_tiny"), "draft_model", 3, checkpoint("qwen3_tiny", seed=2), True,
                          max_running=5)  # 2 groups of 2 per chunk
    assert_same_greedy(plain, spec, n=2, route=[1, 0, 0, 1])


@pytest.mark.parametrize("family", ["glm4_moe_tiny", "deepseek_v3_tiny"])
def test_greedy_with_the_mtp_draft_equals_the_routed_plain_greedy(checkpoint, family):  # noqa: F811
    plain, spec = engines(checkpoint(family, mtp_layers=1), "mtp", 3)
    samples = assert_same_greedy(plain, spec)
    assert any(s.draft_stats[0] > 0 for s in samples)  # rows that end on their first token verify nothing


def test_a_speculative_engine_of_adapters_needs_each_prompts(checkpoint):  # noqa: F811
    _, spec = engines(checkpoint("qwen3_tiny"), "draft_model", 3, checkpoint("qwen3_tiny", seed=2))
    with pytest.raises(ValueError):
        spec.generate(PROMPTS, PROMPTS, n=1, temperature=0.0)
