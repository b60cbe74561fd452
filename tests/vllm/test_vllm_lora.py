"""LoRA through real vLLM (its CPU build's own LoRA support: enable_lora, LoRARequest) against the
native engine holding the same adapters: greedy outputs equal and sampled-token log-probs equal to
the native model's forward with the adapters applied, before the first sync (the base model), after
a sync and after a second one (a new adapter version replaces the first); the checked sync reads
the adapter back from vLLM's LoRA layers and refuses a wrong checksum or a slot that differs.

Tolerance: as tests/vllm/test_vllm_vs_native.py (fp32, oneDNN GEMMs and vLLM's CPU attention and
punica LoRA kernels against torch's), asserted at 2e-5.
"""

import pytest
import torch

from vllm_tier import HAVE_VLLM, NEEDS_VLLM, KV_CACHE_GB

if not HAVE_VLLM:
    pytest.skip(NEEDS_VLLM, allow_module_level=True)

pytestmark = pytest.mark.vllm

from test_vllm_vs_native import LOGPROB_ATOL, greedy, max_logprob_diff  # noqa: E402

RANK, ALPHA = 8, 16.0  # scaling 2


def random_adapters(shapes, seed, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    return {k: scale * torch.randn(shape, generator=g) for k, shape in shapes.items()}


@pytest.fixture(scope="module")
def engines(ckpt):
    from miles.config.schema import DType, LoRACfg, RolloutCfg
    from miles.rollout.native import NativeEngine
    from miles.rollout.vllm_engine import VLLMEngine

    lora = LoRACfg(rank=RANK, alpha=ALPHA)
    engine = VLLMEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0, kv_cache_gb=KV_CACHE_GB,
                        lora=lora)
    native = NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0, lora=lora)
    yield engine, native
    engine.close()


def test_adapters_served_as_the_native_engine_applies_them(engines):
    from miles.transport.checksum import checksum

    engine, native = engines
    base = greedy(engine)  # no sync yet: no LoRARequest, the base model (the trainer's B starts at 0)
    assert engine.adapters.request is None and base == greedy(native)
    assert max_logprob_diff(engine, native, 1.0) < LOGPROB_ATOL

    shapes = engine.adapters.shapes
    assert set(shapes) == set(native.lora.tensors())
    first = random_adapters(shapes, 1)
    assert engine.update_weights(first, checksum(first)) == checksum(first)
    native.update_weights(first, checksum(first))
    after = greedy(engine)
    assert after == greedy(native) and after != base  # the adapter changed what both generate
    for temperature in (1.0, 0.7):
        assert max_logprob_diff(engine, native, temperature) < LOGPROB_ATOL

    second = random_adapters(shapes, 2)
    old_dir = engine.adapters.current.path
    assert engine.update_weights(second, checksum(second)) == checksum(second)
    native.update_weights(second)
    assert engine.adapters.request.lora_name == "miles-lora-2"
    assert engine.llm.llm_engine.list_loras() == {2}  # the first version was dropped, and its directory
    assert not old_dir.exists()
    assert greedy(engine) == greedy(native)
    assert max_logprob_diff(engine, native, 1.0) < LOGPROB_ATOL


def test_the_checked_sync_can_fail(engines):
    from miles.transport.checksum import WeightSyncError, checksum

    engine, _ = engines
    adapters = random_adapters(engine.adapters.shapes, 3)
    with pytest.raises(WeightSyncError, match="different from what the trainer sent"):
        engine.update_weights(adapters, "0" * 64)
    with pytest.raises(ValueError, match="missing"):
        engine.update_weights({k: v for k, v in adapters.items() if "q_proj" not in k})
    engine.update_weights(adapters, checksum(adapters))
    # What vLLM computes with, changed behind the sync's back: the read-back sees it.
    engine.llm.collective_rpc(_bump_first_slot)
    with pytest.raises(WeightSyncError, match="LoRA slot differs"):
        engine.adapters.check_held(adapters, engine.adapters.current)


def _bump_first_slot(worker):
    manager = worker.model_runner.lora_manager._adapter_manager
    module = next(m for m in manager.modules.values() if isinstance(getattr(m, "lora_b_stacked", None), tuple))
    module.lora_b_stacked[0].view(-1)[0] += 1.0
