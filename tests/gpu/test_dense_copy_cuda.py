"""Dense copies on CUDA (`rollout.dense_weight_copies`, miles/precision/dense_copy.py): an FP8 w8a16 /
INT4 engine decoding 320 rows from CUDA graphs samples exactly what the same engine without copies
samples through the one-pass dequantization (the copy is its weight, so the products are the same bits), with
and without fused projections, and after a sync into the captured graphs' copies.

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_dense_copy_cuda.py`."""

from dataclasses import replace

import pytest
import torch

from miles.config.schema import DType, FP8Scheme, ModelCfg, PrecisionCfg, Quant, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained
from miles.orchestrate.checkpoints import random_checkpoint
from miles.precision import int4_triton
from miles.precision.recipe import QuantLinear
from miles.rollout.native import NativeEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = ModelCfg(name="d", hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8, num_kv_heads=4,
                 head_dim=64, max_position_embeddings=128)
PROMPTS = [f"{i}+{i + 7}=" for i in range(40)]  # x 8 samples: 320 rows, past the fused kernels' 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(MODEL, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("m") / "m"))


def engines(ckpt, quant, scheme, fuse):
    precision = PrecisionCfg(name=quant, train_quant=Quant(quant), rollout_quant=Quant(quant),
                             fp8_scheme=FP8Scheme(scheme))
    cfg = RolloutCfg(max_new_tokens=12, max_prompt_len=16, max_running=320, batch_size=40, n_samples_per_prompt=8,
                     fuse_projections=fuse)
    # auto (None): on at this batch on CUDA
    return [NativeEngine(ckpt, replace(cfg, dense_weight_copies=dense), DType.bf16, device="cuda", seed=0,
                         precision=precision) for dense in (False, None)]


def samples(engine):
    out = engine.generate(PROMPTS, ["?"] * len(PROMPTS), n=8, seeds=list(range(len(PROMPTS))))
    return [(s.response_ids, s.rollout_logprobs) for s in out]


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("quant,scheme", [("fp8", "w8a16"), ("int4", "w8a8")])
def test_copies_sample_the_payload_paths_tokens_and_follow_a_sync(ckpt, monkeypatch, quant, scheme, fuse):
    # INT4's fused kernel takes up to 1024 rows (its own summation order); from 257 rows the plain engine
    # here takes the one-pass dequantization + cuBLAS, the path whose bits the copies reproduce.
    monkeypatch.setattr(int4_triton, "FUSED_MAX_ROWS", 256)
    plain, held = engines(ckpt, quant, scheme, fuse)
    assert all(m.dense.numel() > 0 for m in held.model.modules() if isinstance(m, QuantLinear))
    assert not any("dense" in m.held_names() for m in plain.model.modules() if isinstance(m, QuantLinear))
    assert samples(held) == samples(plain)
    other = from_pretrained(ckpt)
    for p in other.parameters():
        p.data.mul_(0.8)
    payload = plain.recipe.sync_payload(other.state_dict())
    for engine in (plain, held):
        engine.update_weights(payload)
    assert samples(held) == samples(plain)  # the graphs read the refreshed copies
