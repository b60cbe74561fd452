"""The rollout protocol's contract (miles/rollout/protocol.py) for the vLLM engine, on real vLLM:
groups of n samples, log-probs, lengths, stop tokens, seeds, memory calls, health."""

import math

import pytest

from vllm_tier import HAVE_VLLM, KV_CACHE_GB, NEEDS_VLLM, PROMPTS

if not HAVE_VLLM:
    pytest.skip(NEEDS_VLLM, allow_module_level=True)

pytestmark = pytest.mark.vllm

LABELS = ["42", "12", "100", "90"]


def test_is_a_rollout_engine(vllm_engine):
    from miles.rollout.protocol import RolloutEngine, check_engine
    from miles.rollout.vllm_engine import VLLMEngine

    check_engine(VLLMEngine)
    assert isinstance(vllm_engine, RolloutEngine)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_groups_logprobs_lengths_and_stops(vllm_engine, temperature):
    engine = vllm_engine
    samples = engine.generate(PROMPTS, LABELS, n=3, temperature=temperature, max_new_tokens=6)
    assert len(samples) == 12
    assert [s.group for s in samples] == [g for g in range(4) for _ in range(3)]
    stop_ids = set(engine.stop_ids)
    for i, s in enumerate(samples):
        assert s.prompt == PROMPTS[i // 3] and s.label == LABELS[i // 3]
        assert s.prompt_ids[0] == engine.tok.bos_id and engine.decode(s.prompt_ids) == PROMPTS[i // 3]
        assert 1 <= len(s.response_ids) <= 6
        assert len(s.rollout_logprobs) == len(s.response_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in s.rollout_logprobs)
        stopped = s.response_ids[-1] in stop_ids
        assert (s.finish_reason.value == "stop") == stopped
        assert (s.finish_reason.value == "length") == (not stopped and len(s.response_ids) == 6)
        assert not stop_ids & set(s.response_ids[:-1])  # a stop token ends the response
        assert s.response == engine.decode(s.response_ids)
    if temperature == 0.0:  # n greedy samples of a prompt are one sample n times
        for g in range(4):
            assert len({tuple(s.response_ids) for s in samples[3 * g:3 * g + 3]}) == 1


def test_stop_tokens_end_responses_and_one_engine_per_process(vllm_engine, ckpt):
    """Every character a stop token: each response is one token, finished by a stop. Building that
    second engine closed the first (vLLM's parallel state is per process), which now says so."""
    from miles.config.schema import DType, RolloutCfg
    from miles.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(ckpt, RolloutCfg(max_new_tokens=7, stop_tokens=list("0123456789+-*=() ")), DType.fp32,
                        kv_cache_gb=KV_CACHE_GB)
    samples = engine.generate(PROMPTS, LABELS, n=4)
    assert all(len(s.response_ids) == 1 and s.finish_reason.value == "stop" for s in samples)
    with pytest.raises(RuntimeError, match="closed"):
        vllm_engine.generate(PROMPTS, LABELS)
    engine.close()
    engine.close()
    with pytest.raises(ValueError, match="rollout.stop_tokens"):
        VLLMEngine(ckpt, RolloutCfg(stop_tokens=["<nope>"]), DType.fp32, kv_cache_gb=KV_CACHE_GB)


def test_seeds_reproduce_groups_whatever_the_batch(vllm_engine):
    """A group's samples depend on its seed only: the same in another call and beside other prompts,
    and consecutive group seeds do not share samples."""
    engine = vllm_engine
    a = engine.generate(PROMPTS, LABELS, n=4, seeds=[11, 12, 13, 14])
    b = engine.generate(PROMPTS, LABELS, n=4, seeds=[11, 12, 13, 14])
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.rollout_logprobs for s in a] == [s.rollout_logprobs for s in b]
    alone = engine.generate(PROMPTS[2:3], LABELS[2:3], n=4, seeds=[13])
    assert [s.response_ids for s in alone] == [s.response_ids for s in a[8:12]]
    same = engine.generate([PROMPTS[0]] * 2, LABELS[:2], n=4, seeds=[11, 12])
    assert [s.response_ids for s in same[:4]] != [s.response_ids for s in same[4:]]
    with pytest.raises(ValueError, match="one per prompt"):
        engine.generate(PROMPTS, LABELS, n=2, seeds=[1])


def test_unseeded_calls_differ(vllm_engine):
    a = vllm_engine.generate(PROMPTS, LABELS, n=4)
    b = vllm_engine.generate(PROMPTS, LABELS, n=4)
    assert [s.response_ids for s in a] != [s.response_ids for s in b]


def test_prompt_ids_and_length_limit(vllm_engine):
    engine = vllm_engine
    ids = [engine.tok.bos_id] + engine.tok.tokenizer.encode("3+4=", add_special_tokens=False).ids
    out = engine.generate(["3+4="], ["7"], n=2, prompt_ids=[ids], temperature=0.0)
    assert all(s.prompt_ids == ids for s in out)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(["1+1=" * 14], ["2"], n=1, max_new_tokens=8)


def test_memory_calls_and_health(vllm_engine):
    engine = vllm_engine
    health = engine.health()
    assert health["engine"] == "vllm" and health["device"] == "cpu" and health["vllm_version"]
    assert health["resident"] == ["weights", "kv_cache"] and health["frees_memory"] is False
    engine.release_memory()
    engine.release_memory(("kv_cache",))  # released already: a no-op
    assert engine.health()["resident"] == []
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS, LABELS)
    engine.resume_memory(("weights",))
    assert engine.health()["resident"] == ["weights"]
    engine.resume_memory()
    assert len(engine.generate(PROMPTS[:1], LABELS[:1], n=2)) == 2
    with pytest.raises(ValueError, match="unknown memory tag"):
        engine.release_memory(("cuda_graph",))
