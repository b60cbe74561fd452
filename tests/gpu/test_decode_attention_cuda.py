"""The slot-decode attention kernel on CUDA: the 4B shapes against SDPA over the slot mask, inside a
CUDA graph, and the engine's sampled log-probs against the trainer's full forward with and without it
(the train / rollout mismatch must stay at bf16's level).

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_decode_attention_cuda.py`
(tests/unit/models/test_decode_attention.py runs compiled there too)."""

import pytest
import torch
from gpu_runs import captured, full_forward_mismatch

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import decode_attention as da
from miles.models.attention import grouped_decode_attention
from miles.models.context import slot_mask
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(da.triton is None, reason="needs triton")]


def _operands(b, h, hkv, s, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, device="cuda", generator=g).bfloat16()
               for shape in ((b, h, 1, d), (b, hkv, s, d), (b, hkv, s, d)))
    past = torch.randint(0, s, (b,), device="cuda", generator=g)
    return q, k, v, past


@pytest.mark.parametrize("rows", [1, 8, 64, 512])
def test_4b_shapes_match_sdpa(rows):
    q, k, v, past = _operands(rows, 32, 8, 384, 128)
    out = da.slot_decode_attention(q, k, v, past)
    ref = grouped_decode_attention(q.float(), k.float(), v.float(), slot_mask(past, 384))
    bf16 = grouped_decode_attention(q, k, v, slot_mask(past, 384))  # the path it replaces
    err = (out.float() - ref).abs().max().item()
    assert err < 1e-2 and err <= 2 * (bf16.float() - ref).abs().max().item() + 1e-3


def test_long_context_split_matches_sdpa():
    q, k, v, past = _operands(2, 32, 8, 8192, 128, seed=1)
    assert da.splits_for(2 * 8, 8192, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    out = da.slot_decode_attention(q, k, v, past)
    ref = grouped_decode_attention(q.float(), k.float(), v.float(), slot_mask(past, 8192))
    assert (out.float() - ref).abs().max().item() < 1e-2


def test_captured_in_a_cuda_graph_equals_eager():
    q, k, v, past = _operands(64, 32, 8, 384, 128, seed=2)
    eager = da.slot_decode_attention(q, k, v, past)
    graph, out = captured(lambda: da.slot_decode_attention(q, k, v, past))
    past += 7  # the graph reads the lengths at replay
    past.clamp_(max=383)
    graph.replay()
    assert torch.equal(out, da.slot_decode_attention(q, k, v, past))


SMALL = ModelCfg(name="qwen3_small", hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                 num_kv_heads=2, head_dim=64, max_position_embeddings=512)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 7), range(33, 99, 5))]


def _mismatch(checkpoint, kernel: bool, monkeypatch) -> tuple[float, int]:
    """Mean |rollout log-prob - full-forward log-prob| over sampled tokens, and the kernel's calls."""
    calls = []
    real = da.slot_decode_attention
    monkeypatch.setattr(da, "slot_decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(da, "enabled", kernel)
    cfg = RolloutCfg(max_new_tokens=48, max_prompt_len=16, max_running=24, sync_every=4)
    engine = NativeEngine(checkpoint, cfg, DType.bf16, device="cuda", seed=0)
    samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=1.0)
    return full_forward_mismatch(samples, checkpoint, torch.bfloat16), len(calls)


def test_engine_mismatch_stays_at_sdpas_level(tmp_path, monkeypatch):
    checkpoint = str(random_checkpoint(SMALL, DEFAULT_ALPHABET, seed=0, out=tmp_path / "m"))
    with_kernel, calls = _mismatch(checkpoint, True, monkeypatch)
    without, no_calls = _mismatch(checkpoint, False, monkeypatch)
    print(f"\nmismatch: kernel {with_kernel:.3e}, SDPA {without:.3e}")
    assert calls > 0 and no_calls == 0
    assert with_kernel <= 1.5 * without + 1e-3
