"""Slot decode (the GPU engine's continuous batching) on the CPU: same samples as the padded engine.

CUDA graphs need a GPU (tests/gpu/test_rollout_cuda.py); everything else of the slot path (admission,
refill of freed slots, tail compaction, per-row cache lengths) runs here in fp32.
"""

from dataclasses import replace

import pytest
import torch

from miles.config.schema import ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained
from miles.models.cache import SlotCache
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.rollout.slots import default_buckets

TINY = ModelCfg(name="tiny", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=16, max_position_embeddings=128)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 99, 3), range(99, 9, -3))][:20]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(TINY, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("m") / "m"))


def engine(ckpt, **kw):
    cfg = replace(RolloutCfg(max_new_tokens=10, max_prompt_len=16, max_running=12, sync_every=3), **kw)
    return NativeEngine(ckpt, cfg, seed=0)


def test_greedy_slot_decode_equals_the_padded_engine_with_refills_and_stops(ckpt):
    slots, padded = engine(ckpt, slot_decode=True), engine(ckpt, slot_decode=False)
    assert slots.slots is not None and padded.slots is None
    # The random model rarely samples eos greedily: also stop at a token it emits in some responses.
    common = padded.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    stop = torch.tensor([common[0].response_ids[4], slots.tok.eos_id])
    slots.stop_ids, padded.stop_ids = stop, stop
    a = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=3, temperature=0.0)  # 60 samples, 12 slots
    b = padded.generate(PROMPTS, ["?"] * len(PROMPTS), n=3, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.finish_reason for s in a] == [s.finish_reason for s in b]
    assert {s.finish_reason.value for s in a} == {"stop", "length"}  # both endings are exercised
    for s, t in zip(a, b):
        assert s.prompt_ids == t.prompt_ids and s.group == t.group
        assert max(abs(x - y) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-5


def test_sampled_slot_responses_have_the_full_forward_logprobs(ckpt):
    slots = engine(ckpt, slot_decode=True)
    model = from_pretrained(ckpt, dtype=torch.float32)
    samples = slots.generate(PROMPTS, ["?"] * len(PROMPTS), n=4)
    assert len(samples) == 80 and all(1 <= len(s.response_ids) <= 10 for s in samples)
    for s in samples[::7]:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(model(ids)[0, :-1], -1)
        start = len(s.prompt_ids) - 1
        full = logp[start:].gather(1, ids[0, start + 1:, None]).squeeze(1)
        assert torch.allclose(full, torch.tensor(s.rollout_logprobs), atol=1e-5)


def test_slot_cache_decode_of_rows_at_different_lengths_equals_the_full_forward(ckpt):
    model = from_pretrained(ckpt, dtype=torch.float32).eval()
    seqs = [torch.randint(1, 20, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 7, 5)]
    cache = SlotCache([layer.attn.new_cache(3, 16, torch.float32, "cpu") for layer in model.layers], 16, 3)
    with torch.no_grad():
        for r, seq in enumerate(seqs):  # each row prefilled alone, then decoded together
            pre = model.new_cache(1, 16)
            model(seq[None, :-1], cache=pre)
            cache.load_prefill(torch.tensor([r]), pre, torch.tensor([0]), len(seq) - 1)
            cache.lengths[r] = len(seq) - 1
        step = model(torch.stack([s[-1] for s in seqs])[:, None], cache=cache)[:, 0]
        for r, seq in enumerate(seqs):
            assert torch.allclose(step[r], model(seq[None])[0, -1], atol=1e-5)


def test_buckets_cover_every_batch_size():
    assert default_buckets(1) == [1]
    assert default_buckets(12) == [1, 2, 3, 4, 6, 8, 12]
    assert default_buckets(512)[-3:] == [256, 384, 512]


def test_slot_decode_refuses_families_without_gqa_mla_or_dsa(compose, tmp_path):
    linear = compose(["model=qwen3_next_tiny"]).model  # linear attention: a recurrent state, no columns
    ckpt = str(random_checkpoint(linear, DEFAULT_ALPHABET, seed=0, out=tmp_path / "m"))
    with pytest.raises(ValueError, match="rollout.slot_decode=true needs GQA, MLA or DSA"):
        engine(ckpt, slot_decode=True)
    assert engine(ckpt).slots is None  # null: the padded path on the CPU


def test_a_shorter_budget_after_a_longer_one_leaves_no_stale_rows(ckpt):
    """Multi-turn calls the engine with shrinking budgets and token-id contexts: slots left from a
    longer call must not index past the shorter call's output columns."""
    slots, padded = engine(ckpt, slot_decode=True), engine(ckpt, slot_decode=False)
    slots.generate(PROMPTS[:12], ["?"] * 12, n=1, temperature=0.0, max_new_tokens=10)  # every slot used
    # 5 rows run in the bucket of 6: slot 5 is left from the first call (10 tokens generated).
    contexts = [slots.tok.tokenizer.encode(p).ids + [5, 6, 7] for p in PROMPTS[:5]]
    a = slots.generate(PROMPTS[:5], ["?"] * 5, n=1, temperature=0.0, max_new_tokens=3, prompt_ids=contexts)
    b = padded.generate(PROMPTS[:5], ["?"] * 5, n=1, temperature=0.0, max_new_tokens=3, prompt_ids=contexts)
    assert [s.response_ids for s in a] == [s.response_ids for s in b] and all(len(s.response_ids) == 3 for s in a)
    assert [s.prompt_ids for s in a] == contexts
