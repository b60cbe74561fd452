"""QLoRA on the FSDP2 trainer over Llama 4 (model=llama4_tiny, precision=int4_qat / fp8, expert adapters):
the transposed expert stacks held quantized (FrozenQuantLlama4Experts) have their codes and scales
sharded between 2 gloo ranks like the projections' (miles/trainer/fsdp_qlora.py), and the ranks train
the adapters the 1-process QLoRA trainer trains on the same batch (test_fsdp_qlora.py's pattern)."""

from dataclasses import replace

import pytest
from grpo_batches import grpo_batch

from miles.config.schema import LoRACfg
from miles.models.frozen_experts import FrozenQuantLlama4Experts
from miles.orchestrate.checkpoints import random_checkpoint

from test_fsdp_qlora import CFG, assert_same_step, fp32_compute, local_ray, one_step_both_ways  # noqa: F401

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama4_ckpt(tmp_path_factory, compose):
    model = compose(["model=llama4_tiny"]).model
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("fsdp_qlora_llama4")))


@pytest.mark.parametrize("quant", ["int4", "fp8"])
def test_llama4_experts_held_quantized_and_adapted_on_two_ranks(llama4_ckpt, local_ray, quant):  # noqa: F811
    batch = grpo_batch(llama4_ckpt)
    cfg = replace(CFG, lora=LoRACfg(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "experts"]))
    precision = fp32_compute(quant)
    one, n_metrics, n_weights, g_metrics, rank_bytes, g_weights = one_step_both_ways(llama4_ckpt, cfg, precision,
                                                                                     batch)
    holders = {f"layers.{i}.mlp.experts": one.model.layers[i].mlp.experts for i in (1, 3)}
    assert all(isinstance(m, FrozenQuantLlama4Experts) for m in holders.values())
    assert_same_step(g_metrics, n_metrics, g_weights, n_weights)
    assert any(float(w.abs().max()) > 0 for k, w in n_weights.items() if ".experts." in k and "lora_B" in k)
    codes = {f"{prefix}.{n}": b.numel() * b.element_size() for prefix, m in holders.items()
             for n, b in m.named_buffers()}
    # Each rank holds its shard of the experts' codes and scales (E = 4: 2 experts a rank), no dense stack.
    assert set(codes) <= set(rank_bytes[0]) and sum(b[n] for b in rank_bytes for n in codes) == sum(codes.values())
    assert all(sum(b[n] for n in codes) <= 0.55 * sum(codes.values()) for b in rank_bytes)
