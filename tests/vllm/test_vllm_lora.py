"""LoRA through real vLLM (its CPU build's own LoRA support: enable_lora, LoRARequest) against the
native engine holding the same adapters: greedy outputs equal and sampled-token log-probs equal to
the native model's forward with the adapters applied, before the first sync (the base model), after
a sync and after a second one (a new adapter version replaces the first); the checked sync reads
the adapter back from vLLM's LoRA layers and refuses a wrong checksum or a slot that differs.

Several adapters (trainer.lora.adapters=[add, mul], max_loras=2): one batch mixing them, each
prompt's request naming its adapter; each prompt's greedy response and log-probs equal what vLLM gives
that prompt alone with its adapter (bit for bit, as measured), and the native engine's (its routed
batch; its forward routed to the sample's adapter, within the tolerance below: measured 7e-7 at T = 1,
9.5e-7 at T = 0.7); a second sync replaces both versions; the checked sync reads back every adapter's
slot and names the one that differs.

Tolerance: as tests/vllm/test_vllm_vs_native.py (fp32, oneDNN GEMMs and vLLM's CPU attention and
punica LoRA kernels against torch's), asserted at 2e-5.
"""

import time

import pytest
import torch

from vllm_tier import HAVE_VLLM, NEEDS_VLLM, KV_CACHE_GB

if not HAVE_VLLM:
    pytest.skip(NEEDS_VLLM, allow_module_level=True)

pytestmark = pytest.mark.vllm

from test_vllm_vs_native import (LOGPROB_ATOL, MORE_PROMPTS, greedy, max_logprob_diff,  # noqa: E402
                                 native_forward_logprobs)

RANK, ALPHA = 8, 16.0  # scaling 2
ROUTE = [0, 1, 1, 0, 1, 0, 0, 1]  # MORE_PROMPTS' adapters ("add", "mul"): a batch that mixes them


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
    assert engine.adapters.versions.current == [None] and base == greedy(native)
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
    old_dir = engine.adapters.versions.current[0].path
    assert engine.update_weights(second, checksum(second)) == checksum(second)
    native.update_weights(second)
    assert engine.health()["lora_adapters"] == ["miles-lora-2"]
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
    with pytest.raises(WeightSyncError, match="LoRA slots differ"):
        engine.adapters.check_held(adapters)


def _bump_first_slot(worker):
    manager = worker.model_runner.lora_manager._adapter_manager
    module = next(m for m in manager.modules.values() if isinstance(getattr(m, "lora_b_stacked", None), tuple))
    module.lora_b_stacked[0].view(-1)[0] += 1.0


@pytest.fixture(scope="module")
def two_engines(ckpt, engines):  # after the one-adapter tests: vLLM holds one engine per process
    from miles.config.schema import DType, LoRACfg, RolloutCfg
    from miles.rollout.native import NativeEngine
    from miles.rollout.vllm_engine import VLLMEngine

    lora = LoRACfg(rank=RANK, alpha=ALPHA, adapters=["add", "mul"])
    engine = VLLMEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0, kv_cache_gb=KV_CACHE_GB,
                        lora=lora)
    native = NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0, lora=lora)
    yield engine, native
    engine.close()


def routed_greedy(engine, route, n=2):
    return engine.generate(MORE_PROMPTS, ["?"] * len(MORE_PROMPTS), n=n, temperature=0.0, adapters=route)


def routed_logprob_diff(engine, native, temperature):
    """max |vLLM's log-prob - the native model's forward routed to the sample's adapter|, mixed batch."""
    samples = engine.generate(MORE_PROMPTS, ["?"] * len(MORE_PROMPTS), n=3, temperature=temperature,
                              seeds=list(range(len(MORE_PROMPTS))), adapters=ROUTE)
    assert [s.adapter for s in samples] == [k for k in ROUTE for _ in range(3)]
    diffs = []
    for s in samples:
        native.lora.route(torch.tensor([[s.adapter]]))
        diffs.append((torch.tensor(s.rollout_logprobs) - native_forward_logprobs(native, s, temperature)).abs().max())
    return max(diffs).item()


def test_two_adapters_served_in_one_batch(two_engines):
    from miles.transport.checksum import checksum

    engine, native = two_engines
    shapes = engine.adapters.shapes
    assert set(shapes) == set(native.lora.tensors())  # "add/<module>..." and "mul/<module>...", as synced
    first = random_adapters(shapes, 11)
    start = time.perf_counter()
    assert engine.update_weights(first, checksum(first)) == checksum(first)
    print(f"checked sync of 2 adapters: {1e3 * (time.perf_counter() - start):.1f} ms")
    native.update_weights(first, checksum(first))

    mixed = routed_greedy(engine, ROUTE)
    assert [s.adapter for s in mixed] == [k for k in ROUTE for _ in range(2)]
    assert [s.response_ids for s in mixed] == [s.response_ids for s in routed_greedy(native, ROUTE)]
    alone_diff = 0.0
    for i, k in enumerate(ROUTE):  # each prompt alone, with its adapter: what the mixed batch gave it
        alone = engine.generate(MORE_PROMPTS[i:i + 1], ["?"], n=1, temperature=0.0, adapters=[k])[0]
        assert alone.response_ids == mixed[2 * i].response_ids
        together = mixed[2 * i].rollout_logprobs
        alone_diff = max(alone_diff, max(abs(x - y) for x, y in zip(alone.rollout_logprobs, together)))
    swapped = routed_greedy(engine, [1 - k for k in ROUTE])
    assert [s.response_ids for s in swapped] != [s.response_ids for s in mixed]  # the adapters differ: routing shows
    diffs = {t: routed_logprob_diff(engine, native, t) for t in (1.0, 0.7)}
    print(f"mixed batch vs alone: max log-prob diff {alone_diff:.2e}; vs the native forward: {diffs}")
    assert alone_diff == 0.0  # measured: a row's numbers do not depend on the other rows' adapters
    assert max(diffs.values()) < LOGPROB_ATOL

    second = random_adapters(shapes, 12)
    old = [a.path for a in engine.adapters.versions.current]
    assert engine.update_weights(second, checksum(second)) == checksum(second)
    native.update_weights(second)
    assert engine.health()["lora_adapters"] == ["miles-lora-add-3", "miles-lora-mul-4"]
    assert engine.llm.llm_engine.list_loras() == {3, 4} and not any(path.exists() for path in old)
    responses = [[s.response_ids for s in routed_greedy(e, ROUTE)] for e in (engine, native)]
    assert responses[0] == responses[1]
    assert routed_logprob_diff(engine, native, 1.0) < LOGPROB_ATOL
    with pytest.raises(ValueError, match="one LoRA adapter id per prompt"):
        greedy(engine)


def test_the_checked_sync_reads_back_every_adapter(two_engines):
    from miles.transport.checksum import WeightSyncError, checksum

    engine, _ = two_engines
    adapters = random_adapters(engine.adapters.shapes, 13)
    engine.update_weights(adapters, checksum(adapters))
    mul = engine.adapters.versions.current[1]
    engine.llm.collective_rpc(_bump_slot, args=(mul.number,))  # "mul"'s slot, behind the sync's back
    with pytest.raises(WeightSyncError, match=f"{mul.name}: 1 tensors differ") as error:
        engine.adapters.check_held(adapters)
    assert "miles-lora-add" not in str(error.value)  # "add"'s slot is intact


def _bump_slot(worker, lora_id):
    manager = worker.model_runner.lora_manager._adapter_manager
    module = next(m for m in manager.modules.values() if isinstance(getattr(m, "lora_b_stacked", None), tuple))
    module.lora_b_stacked[0][manager.lora_index_to_id.index(lora_id)].view(-1)[0] += 1.0
