"""rollout.fuse_projections on CUDA: the engine's decode graphs with one GEMM for q / k / v and for
gate / up (views of the flat weight buffer) against the unfused engine: the sampled log-probs against
the trainer's full forward stay at the unfused level, and a weight sync reaches the fused views.

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_fused_projections_cuda.py`;
speed: `python benchmarks/precision_decode.py --model qwen3_4b --rows 64 512 --recipes bf16 --variants triton fused`."""

from dataclasses import replace

import pytest
import torch

from gpu_runs import full_forward_mismatch

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained, fused_projections
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SMALL = ModelCfg(name="qwen3_small", hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                 num_kv_heads=2, head_dim=64, max_position_embeddings=512)
PROMPTS = [f"{a}+{b}=" for a, b in zip(range(10, 90, 7), range(33, 99, 5))]


def _mismatch(engine, checkpoint) -> float:
    samples = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=2, temperature=1.0)
    return full_forward_mismatch(samples, checkpoint, torch.bfloat16)


def test_fused_engine_mismatch_and_sync(tmp_path):
    checkpoint = str(random_checkpoint(SMALL, DEFAULT_ALPHABET, seed=0, out=tmp_path / "m"))
    cfg = RolloutCfg(max_new_tokens=48, max_prompt_len=16, max_running=24, sync_every=4)
    plain = NativeEngine(checkpoint, cfg, DType.bf16, device="cuda", seed=0)
    fused = NativeEngine(checkpoint, replace(cfg, fuse_projections=True), DType.bf16, device="cuda", seed=0)
    assert fused.slots.captured and fused_projections.enable(fused.model) == 2 * SMALL.num_layers
    with_fusion, without = _mismatch(fused, checkpoint), _mismatch(plain, checkpoint)
    print(f"\nmismatch: fused {with_fusion:.3e}, unfused {without:.3e}")
    assert with_fusion <= 1.5 * without + 1e-3
    # A sync into the flat buffer reaches the captured graphs' fused views: greedy tokens as the plain engine's.
    other = from_pretrained(checkpoint)
    for p in other.parameters():
        p.data.mul_(1.25)
    for engine in (plain, fused):
        engine.update_weights({k: v.to(torch.bfloat16) for k, v in other.state_dict().items()})
    a = plain.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    b = fused.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    same = sum(s.response_ids == t.response_ids for s, t in zip(a, b))
    assert same >= len(PROMPTS) - 2  # bf16 near-ties may flip a greedy token, not most rows


@pytest.mark.parametrize("quant,scheme", [("int4", "w8a8"), ("fp8", "w8a16")])
def test_weight_only_groups_joined_in_the_graphs(tmp_path, quant, scheme):
    """FP8 w8a16 / INT4: the fused weight-only kernels over the joined payloads, captured in the
    decode graphs: greedy tokens as the unfused engine's (bf16 near-ties aside)."""
    from miles.config.schema import FP8Scheme, PrecisionCfg, Quant

    checkpoint = str(random_checkpoint(SMALL, DEFAULT_ALPHABET, seed=0, out=tmp_path / "m"))
    precision = PrecisionCfg(name=quant, rollout_quant=Quant(quant), fp8_scheme=FP8Scheme(scheme))
    cfg = RolloutCfg(max_new_tokens=32, max_prompt_len=16, max_running=24, sync_every=4)
    plain = NativeEngine(checkpoint, cfg, DType.bf16, device="cuda", seed=0, precision=precision)
    fused = NativeEngine(checkpoint, replace(cfg, fuse_projections=True), DType.bf16, device="cuda", seed=0,
                         precision=precision)
    assert fused.slots.captured and fused_projections.enable(fused.model) == 2 * SMALL.num_layers
    a = plain.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    b = fused.generate(PROMPTS, ["?"] * len(PROMPTS), n=1, temperature=0.0)
    assert sum(s.response_ids == t.response_ids for s, t in zip(a, b)) >= len(PROMPTS) - 2
