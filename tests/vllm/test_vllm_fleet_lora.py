"""Several LoRA adapters on a vLLM fleet under Ray (rollout.num_engines=2, trainer.lora.adapters=[add, mul]):
two VLLMEngine actors behind the run's router (miles/rollout/router.py EngineFleet), as launch.py builds
them. Every engine holds every adapter: a checked sync reaches both (each reads its slots back), every
chunk the router hands out mixes the two adapters, so each engine serves prompts of both, and each
sample's log-probs equal the native model's forward routed to that sample's adapter (the tolerance of
tests/vllm/test_vllm_lora.py, 2e-5); routed to the other adapter they are far apart (a control). A
second sync replaces both versions on both engines; a wrong checksum is refused through the fleet; an
engine actor killed between syncs is restarted by the router with every adapter (checked) and serves both.
"""

import pytest
import torch

from vllm_tier import HAVE_VLLM, NEEDS_VLLM, KV_CACHE_GB

if not HAVE_VLLM:
    pytest.skip(NEEDS_VLLM, allow_module_level=True)

pytestmark = pytest.mark.vllm

from test_vllm_lora import ALPHA, RANK, ROUTE, random_adapters  # noqa: E402
from test_vllm_vs_native import LOGPROB_ATOL, MORE_PROMPTS, native_forward_logprobs  # noqa: E402

ADAPTERS = ["add", "mul"]
SAMPLES = 3  # per prompt


@pytest.fixture(scope="module")
def fleet(ckpt):
    import ray

    from miles.config.schema import DType, LoRACfg, RolloutCfg
    from miles.orchestrate.handles import spawn, start_ray
    from miles.rollout.native import NativeEngine
    from miles.rollout.router import EngineFleet
    from miles.rollout.vllm_engine import VLLMEngine

    class RecordingFleet(EngineFleet):
        """The router, noting which engine got which chunk's adapters."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.dispatched: list[tuple[int, list[int]]] = []

        def _submit(self, i, method, *args, **kwargs):
            if method == "generate":
                self.dispatched.append((i, list(kwargs["adapters"])))
            return super()._submit(i, method, *args, **kwargs)

    lora = LoRACfg(rank=RANK, alpha=ALPHA, adapters=ADAPTERS)
    started_here = not ray.is_initialized()
    start_ray(None, None)
    handles = [spawn(VLLMEngine, True, ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, "cpu", 1, 0,
                     kv_cache_gb=KV_CACHE_GB, lora=lora) for _ in range(2)]
    # Two prompts a chunk: ROUTE's pairs each mix "add" and "mul", so every chunk holds both adapters.
    router = RecordingFleet(handles, chunk_groups=2)
    native = NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0, lora=lora)
    try:
        yield router, native
    finally:
        for handle in handles:
            handle.call("close")
            ray.kill(handle.actor, no_restart=True)
        if started_here:
            ray.shutdown()


def shapes_of(native):
    return {name: tuple(t.shape) for name, t in native.lora.tensors().items()}


def routed_diffs(samples, native, temperature, swap=False):
    """Per sample: max |vLLM's log-prob - the native forward routed to its adapter (the other: swap)|."""
    diffs = []
    for s in samples:
        native.lora.route(torch.tensor([[1 - s.adapter if swap else s.adapter]]))
        got = torch.tensor(s.rollout_logprobs)
        diffs.append((got - native_forward_logprobs(native, s, temperature)).abs().max().item())
    return diffs


def test_every_engine_serves_every_adapter(fleet):
    from miles.transport.checksum import checksum

    router, native = fleet
    first = random_adapters(shapes_of(native), 21)
    assert router.update_weights(first, checksum(first)) == [checksum(first)] * 2  # each engine's read-back
    native.update_weights(first, checksum(first))
    assert [h.call("health")["lora_adapters"] for h in router.engines] == [["miles-lora-add-1", "miles-lora-mul-2"]] * 2

    labels = ["?"] * len(MORE_PROMPTS)
    for temperature in (1.0, 0.7):
        router.dispatched.clear()
        samples = router.generate(MORE_PROMPTS, labels, n=SAMPLES, temperature=temperature,
                                  seeds=list(range(len(MORE_PROMPTS))), adapters=ROUTE)
        assert [s.adapter for s in samples] == [k for k in ROUTE for _ in range(SAMPLES)]
        served = {i: set() for i in range(2)}
        for i, chunk in router.dispatched:
            served[i] |= set(chunk)
        assert served == {0: {0, 1}, 1: {0, 1}}, router.dispatched  # both adapters on both engines
        diffs = routed_diffs(samples, native, temperature)
        swapped = routed_diffs(samples, native, temperature, swap=True)
        print(f"T={temperature}: {router.dispatched}; max |vLLM fleet - native routed| {max(diffs):.2e}, "
              f"routed to the other adapter: min {min(swapped):.2e}")
        assert max(diffs) < LOGPROB_ATOL
        assert min(swapped) > 100 * LOGPROB_ATOL  # the control: the adapters differ on every sample

    # Seeded per prompt: the fleet's samples are what one engine gives the whole batch.
    one = router.engines[1].call("generate", MORE_PROMPTS, labels, SAMPLES, 0.7, seeds=list(range(len(MORE_PROMPTS))),
                                 adapters=ROUTE)
    assert [s.response_ids for s in one] == [s.response_ids for s in samples]


def test_a_sync_replaces_every_adapter_on_every_engine(fleet):
    from miles.transport.checksum import WeightSyncError, checksum

    router, native = fleet
    second = random_adapters(shapes_of(native), 22)
    held = router.update_weights(second, checksum(second))
    assert held == [checksum(second)] * 2
    names = [h.call("health")["lora_adapters"] for h in router.engines]
    assert names[0] == names[1] and len(names[0]) == 2 and not {"miles-lora-add-1", "miles-lora-mul-2"} & set(names[0])
    native.update_weights(second)
    samples = router.generate(MORE_PROMPTS, ["?"] * len(MORE_PROMPTS), n=2, temperature=1.0,
                              seeds=list(range(len(MORE_PROMPTS))), adapters=ROUTE)
    assert max(routed_diffs(samples, native, 1.0)) < LOGPROB_ATOL
    with pytest.raises(WeightSyncError):  # a checksum error is raised, never retried on another engine
        router.update_weights(random_adapters(shapes_of(native), 23), "0" * 64)


@pytest.mark.extended  # make test-extended: the fleet's restart runs in tests/unit/rollout/test_router.py
def test_a_dead_engine_comes_back_with_every_adapter(fleet):
    """Failover: an engine actor killed between syncs is restarted by the router, given the fleet's last
    adapters (checked) before it takes work, and its chunks are served by their adapters as before."""
    import ray

    from miles.transport.checksum import checksum

    router, native = fleet
    third = random_adapters(shapes_of(native), 24)
    assert router.update_weights(third, checksum(third)) == [checksum(third)] * 2
    native.update_weights(third)
    ray.kill(router.engines[1].actor, no_restart=True)
    router.dispatched.clear()
    samples = router.generate(MORE_PROMPTS, ["?"] * len(MORE_PROMPTS), n=2, temperature=1.0,
                              seeds=list(range(len(MORE_PROMPTS))), adapters=ROUTE)
    assert router.restarts == [0, 1]
    assert len(router.engines[1].call("health")["lora_adapters"]) == 2  # the restarted engine holds both
    assert [s.adapter for s in samples] == [k for k in ROUTE for _ in range(2)]
    assert max(routed_diffs(samples, native, 1.0)) < LOGPROB_ATOL
    # The restarted engine itself serves both adapters (the router may have given engine 0 the rest).
    again = router.engines[1].call("generate", MORE_PROMPTS, ["?"] * len(MORE_PROMPTS), 2, 1.0,
                                   seeds=list(range(len(MORE_PROMPTS))), adapters=ROUTE)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]
    assert max(routed_diffs(again, native, 1.0)) < LOGPROB_ATOL
