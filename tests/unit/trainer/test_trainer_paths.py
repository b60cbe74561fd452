"""The trainer's fast paths give the reference paths' numbers (fp32, CPU):

packed vs padded micro-batches (every loss aggregation, one and two optimizer steps, SFT, the
critic), chunked vs whole-logits LM head, recomputed vs stored activations (under every precision
recipe too: fp8 w8a16 / w8a8, int4_qat, forward_weights=rollout), the old log-probs taken
from the training forward vs a separate forward, and the LM head applied outside the precision
recipe only where the recipe leaves it unquantized.

Tolerance where the paths sum in another order: metrics 1e-5; the step's gradients 1e-6 of each
tensor's largest element (float rounding: they agree to ~3e-7); updated weights 1e-5 wherever the
gradient is clear of Adam's eps (|g| > 1e-6), 2e-4 (2% of lr) where it is not: Adam's first
update is lr * g / (|g| + eps), so for |g| ~ eps = 1e-8 a rounding of g moves it by a share of lr.
Exact where both paths run the same kernels on the same tensors.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointError

import miles.models.packed as packed
import miles.trainer.packing as packing
from miles.config.schema import (AlgoCfg, AlgoName, CriticCfg, DType, FP8Scheme, ForwardWeights, ModelCfg, PrecisionCfg,
                                 Quant, TrainerCfg)
from miles.models.config import MoEConfig
from miles.orchestrate.checkpoints import random_checkpoint
from miles.trainer import held_weights
from miles.trainer.critic import TorchCritic
from miles.trainer.forward import head_outside
from miles.trainer.torch_trainer import TorchTrainer

from grpo_batches import grpo_batch

FP32 = PrecisionCfg(name="fp32")


def grpo(**kw):
    return AlgoCfg(name=AlgoName.grpo, **kw)


def cfg(pack: bool, **kw):
    # 24 tokens per packed micro-batch: two rows of the longest sample, several micro-batches per step
    return TrainerCfg(**{"lr": 1e-2, "global_batch_size": 16, "micro_batch_size": 4, "pack_sequences": pack,
                         "max_tokens_per_micro_batch": 24, **kw})


def run(ckpt, batch, algo, trainer_cfg, precision=FP32, **kw):
    trainer = TorchTrainer(ckpt, algo, trainer_cfg, precision, max_response_len=5, **kw)
    return trainer.train_rl(batch), params_and_grads(trainer.model)


def params_and_grads(model):
    """Each parameter after the update and the gradient of the last optimizer step."""
    return {k: (p.detach().clone(), torch.zeros_like(p) if p.grad is None else p.grad.clone())
            for k, p in model.named_parameters()}


def assert_same(a, b, exact=False, grad_tol=1e-6):
    (ma, wa), (mb, wb) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k] == mb[k] if exact else ma[k] == pytest.approx(mb[k], abs=1e-6, rel=1e-5), k
    for k in wa:
        (w1, g1), (w2, g2) = wa[k], wb[k]
        if exact:
            assert torch.equal(w1, w2) and torch.equal(g1, g2), k
            continue
        torch.testing.assert_close(g1, g2, atol=grad_tol * float(g2.abs().max()), rtol=0, msg=k)
        clear = g2.abs() > 1e-6
        torch.testing.assert_close(w1[clear], w2[clear], atol=1e-5, rtol=0, msg=k)
        torch.testing.assert_close(w1, w2, atol=2e-4, rtol=0, msg=k)  # a flipped sign would be >= 5e-3


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"])
def test_packed_equals_padded(ckpt, rollout_batch, agg):
    algo = grpo(loss_agg=agg, entropy_coef=0.01)
    packed = run(ckpt, rollout_batch, algo, cfg(True))
    padded = run(ckpt, rollout_batch, algo, cfg(False))
    assert packed[0]["train/ppo_kl"] == 0.0 and packed[0]["train/pg_clipfrac"] == 0.0
    assert_same(packed, padded)


def test_packed_equals_padded_over_two_steps_with_a_reference(ckpt, rollout_batch):
    algo = grpo(num_steps_per_rollout=2, kl_coef=0.1, loss_agg="seq_mean_token_mean")
    packed = run(ckpt, rollout_batch, algo, cfg(True, global_batch_size=8))
    padded = run(ckpt, rollout_batch, algo, cfg(False, global_batch_size=8))
    assert packed[0]["train/ppo_kl"] != 0.0  # the second step sees a moved policy
    # ... moved by first updates that agree to 1e-4 only (Adam near eps, see above)
    assert_same(packed, padded, grad_tol=1e-4)


@pytest.mark.parametrize("pack", [True, False])
def test_old_logprobs_from_the_training_forward_equal_a_separate_forward(ckpt, rollout_batch, pack):
    algo = grpo(kl_coef=0.05, entropy_coef=0.01)
    fused = run(ckpt, rollout_batch, algo, cfg(pack))
    separate = run(ckpt, rollout_batch, algo, cfg(pack), reuse_forward_for_old=False)
    assert fused[0]["train/ppo_kl"] == 0.0
    assert_same(fused, separate, exact=True)


def test_chunked_head_equals_whole_logits(ckpt, rollout_batch):
    algo = grpo(entropy_coef=0.01, loss_agg="seq_mean_token_mean")
    chunked = run(ckpt, rollout_batch, algo, cfg(True), logits_chunk_tokens=5)
    whole = run(ckpt, rollout_batch, algo, cfg(True), logits_chunk_tokens=0)
    assert_same(chunked, whole)


@pytest.mark.parametrize("pack", [True, False])
def test_recompute_gives_the_same_update(ckpt, rollout_batch, pack):
    algo = grpo(entropy_coef=0.01)
    stored = run(ckpt, rollout_batch, algo, cfg(pack))
    recomputed = run(ckpt, rollout_batch, algo, cfg(pack, recompute=True))
    assert_same(stored, recomputed, exact=True)


def _blockwise_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, enable_gqa=False, window_size=None):
    """Stands in for FlashAttention's varlen kernel on the CPU: one causal SDPA per block."""
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        blk = [x[a:b].transpose(0, 1)[None] for x in (q, k, v)]
        out[a:b] = F.scaled_dot_product_attention(*blk, is_causal=True, enable_gqa=enable_gqa)[0].transpose(0, 1)
    return out


def test_varlen_layout_one_row_per_micro_batch_equals_padded(ckpt, rollout_batch, monkeypatch):
    # The CUDA layout (a micro-batch = one row, block bounds handed to the kernel), recomputed in
    # backward after the forward's varlen_layout block has closed.
    algo = grpo(entropy_coef=0.01)
    padded = run(ckpt, rollout_batch, algo, cfg(False))
    for module in (packed, packing):
        monkeypatch.setattr(module, "uses_varlen", lambda *_: True)
    monkeypatch.setattr(packed, "_varlen_attn", lambda: _blockwise_varlen)
    trainer = TorchTrainer(ckpt, algo, cfg(True, recompute=True), FP32, max_response_len=5)
    assert all(mb.input_ids.shape[0] == 1 for mb in trainer.plan(rollout_batch, trainer.model))
    varlen = trainer.train_rl(rollout_batch), params_and_grads(trainer.model)
    assert_same(varlen, padded)


RECIPES = {  # the training forwards that swap weights into the layers (and patch FP8 linears) as they run
    "fp8_w8a16": PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme.w8a16),
    "fp8_w8a8": PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme.w8a8),
    "int4_qat": PrecisionCfg(name="int4_qat", train_quant=Quant.int4, rollout_quant=Quant.int4, int4_group_size=32),
    "forward_weights_rollout": PrecisionCfg(name="bf16", rollout_dtype=DType.bf16,
                                            forward_weights=ForwardWeights.rollout),
}


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    moe = ModelCfg(name="m", family="qwen3_moe", hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, max_position_embeddings=64,
                   moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    ckpt = str(random_checkpoint(moe, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("moe")))
    return ckpt, grpo_batch(ckpt)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_gives_the_same_update_under_every_recipe(ckpt, rollout_batch, recipe, monkeypatch):
    algo = grpo(entropy_coef=0.01)
    stored = run(ckpt, rollout_batch, algo, cfg(True), RECIPES[recipe])
    recomputed = run(ckpt, rollout_batch, algo, cfg(True, recompute=True), RECIPES[recipe])
    assert_same(stored, recomputed, exact=True)
    # Negative control: a recomputation that does not put the forward's weights back computes on the
    # fp32 masters (why these recipes were refused with recompute before). Where the fake-quantized
    # weights are fp32 too the update silently differs; checkpoint's own checks catch w8a8 (the plain
    # nn.Linear saves other tensors than its FP8 product), and the bf16 casts fail on dtypes (a bf16
    # norm output into an fp32 master linear).
    monkeypatch.setattr(held_weights, "_put", lambda state: None)
    if recipe in ("fp8_w8a8", "forward_weights_rollout"):
        with pytest.raises((CheckpointError, RuntimeError)):
            run(ckpt, rollout_batch, algo, cfg(True, recompute=True), RECIPES[recipe])
        return
    naive = run(ckpt, rollout_batch, algo, cfg(True, recompute=True), RECIPES[recipe])
    assert any(not torch.equal(naive[1][k][1], stored[1][k][1]) for k in stored[1])


@pytest.mark.parametrize("recipe", ["fp32", "int4_qat"])
def test_recompute_under_true_on_policy(ckpt, rollout_batch, recipe):
    # The batch-invariant kernels are a mode of the forward; the recomputation in backward runs under
    # it too (it failed checkpoint's saved-tensor check before).
    precision = FP32 if recipe == "fp32" else RECIPES[recipe]
    stored = run(ckpt, rollout_batch, grpo(), cfg(False), precision, true_on_policy=True)
    assert_same(stored, run(ckpt, rollout_batch, grpo(), cfg(False, recompute=True), precision, true_on_policy=True),
                exact=True)


@pytest.mark.parametrize("recipe", ["fp8_w8a16", "int4_qat"])
def test_recompute_under_a_recipe_on_moe_experts(moe_ckpt, recipe):
    # The stacked expert tensors are fake-quantized parameters too (not nn.Linear weights).
    ckpt, batch = moe_ckpt
    stored = run(ckpt, batch, grpo(), cfg(True), RECIPES[recipe])
    assert_same(stored, run(ckpt, batch, grpo(), cfg(True, recompute=True), RECIPES[recipe]), exact=True)


@pytest.mark.parametrize("quant", [Quant.fp8, Quant.int4])
def test_head_outside_the_recipe_only_when_it_stays_high_precision(ckpt, rollout_batch, quant):
    kept = PrecisionCfg(name="q", train_quant=quant, rollout_quant=quant, int4_group_size=32)
    trainer = TorchTrainer(ckpt, grpo(), cfg(True), kept)
    assert head_outside(trainer.model, trainer.recipe)  # the shipped keep list: lm_head high precision
    reference = TorchTrainer(ckpt, grpo(), cfg(True), kept, logits_chunk_tokens=0)  # head inside Recipe.forward
    torch.testing.assert_close(trainer.logprobs(rollout_batch), reference.logprobs(rollout_batch), atol=1e-6, rtol=1e-6)

    quantized = PrecisionCfg(name="q", train_quant=quant, rollout_quant=quant, int4_group_size=32,
                             keep_high_precision=["norm"])
    trainer = TorchTrainer(ckpt, grpo(), cfg(True), quantized)
    assert not head_outside(trainer.model, trainer.recipe)  # so the model's own (fake-quantized) head runs
    reference = TorchTrainer(ckpt, grpo(), cfg(True), quantized, logits_chunk_tokens=0)
    assert torch.equal(trainer.logprobs(rollout_batch), reference.logprobs(rollout_batch))


def test_sft_packed_equals_padded(ckpt, rollout_batch):
    sft = AlgoCfg(name=AlgoName.sft, policy_loss="nll")
    results = []
    for pack in (True, False):
        trainer = TorchTrainer(ckpt, sft, cfg(pack), FP32)
        results.append((trainer.train_sft(rollout_batch), params_and_grads(trainer.model)))
    assert_same(*results)


def test_critic_packed_equals_padded(ckpt, rollout_batch):
    batch = rollout_batch.slice(0, 16)
    batch.values, batch.returns = torch.zeros_like(batch.loss_mask), batch.loss_mask.clone()
    results = []
    for pack in (True, False):
        critic = TorchCritic(ckpt, CriticCfg(lr=1e-2), cfg(pack), FP32)
        metrics = critic.train(batch)
        results.append((metrics, params_and_grads(critic.model)))
    assert_same(*results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_packed_varlen_matches_padded(ckpt, rollout_batch):
    bf16 = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
    algo = grpo(entropy_coef=0.01)
    m_packed, _ = run(ckpt, rollout_batch, algo, cfg(True, recompute=True), bf16, device="cuda")
    m_padded, _ = run(ckpt, rollout_batch, algo, cfg(False), bf16, device="cuda")
    assert m_packed["train/ppo_kl"] == 0.0 and m_packed["train/pg_clipfrac"] == 0.0
    for k in ("train/loss", "train/entropy", "train/grad_norm"):
        assert m_packed[k] == pytest.approx(m_padded[k], rel=3e-2, abs=1e-3), k
