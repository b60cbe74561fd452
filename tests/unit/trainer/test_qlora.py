"""QLoRA (trainer.lora with precision=fp8 / int4_qat): the trainer's frozen base held in the rollout
format, in-process against real references.

- a fresh adapter gives the recipe's own (non-LoRA) log-probs bit for bit, and a step moves the
  adapters as LoRA over the recipe's dense fp32 masters does (the straight-through backward);
- the base is held as FP8 codes / packed INT4 + fp32 scales (dtypes, bytes), the same bits the engine
  holds, and never changes; only the adapters travel;
- after a step the engine's log-probs of its own samples equal the trainer's (fp32 compute: the
  recipes' CPU tolerance, their logits being bitwise equal without LoRA), and not without the sync;
- resume is exact; the merged export is the dequantized base plus the adapter; merging in the
  engine and a reference of another base are refused;
- several adapters route over the one held base; a MoE model's experts are held quantized too
  (tests/unit/trainer/test_qlora_experts.py).
"""

import pytest
import torch

from miles.algo.registry import ADVANTAGES, get
from miles.config.schema import (AlgoCfg, AlgoName, DType, FP8Scheme, LoRACfg, ModelCfg, PrecisionCfg, Quant,
                                 RolloutCfg, TrainerCfg)
from miles.models.lora import LoRA
from miles.orchestrate.checkpoints import random_checkpoint
from miles.precision.qlora import FrozenQuantLinear
from miles.precision.recipe import QuantLinear
from miles.precision.rollout_format import rollout_checksum
from miles.rollout.native import NativeEngine
from miles.trainer import lora as lora_side
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch

LORA8 = LoRACfg(rank=8, alpha=16.0)
PROMPTS, LABELS = ["1+2=", "33+4=", "50+50=", "7+8="], ["3", "37", "100", "15"]


def recipe(quant: str, dtype: str = "bf16") -> PrecisionCfg:
    """fp8 / int4_qat as conf/precision ships them (bf16), or their fp32-compute variant;
    "fp8_w8a16": fp8 with precision.fp8_scheme=w8a16."""
    scheme = FP8Scheme.w8a16 if quant == "fp8_w8a16" else FP8Scheme.w8a8
    quant = quant.removesuffix("_w8a16")
    return PrecisionCfg(name={"fp8": "fp8", "int4": "int4_qat"}[quant], train_dtype=DType(dtype),
                        rollout_dtype=DType(dtype), train_quant=Quant(quant), rollout_quant=Quant(quant),
                        fp8_scheme=scheme)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """128 / 256 wide: whole 128-blocks and INT4 groups (K = 128 and 256), so the rounding is real."""
    model = ModelCfg(name="t", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64)
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("qlora")))


def batch_of(engine, prompts=PROMPTS, labels=LABELS):
    samples = engine.generate(prompts, labels, n=4)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(len(samples))])
    adv = get(ADVANTAGES, "a", "grpo")(rewards, torch.tensor([s.group for s in samples]))
    return build_train_batch(samples, adv, engine.pad_id)


@pytest.fixture(scope="module")
def batch(ckpt):
    return batch_of(NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0))


def trainer(ckpt, precision, lora=LORA8, optimizer="adamw", recompute=False, **algo):
    return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo, **algo),
                        TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=4, lora=lora, recompute=recompute),
                        precision, optimizer=optimizer)


def dense_base_attach(model, cfg, precision, seed, recipe, masters=False):
    """The reference: LoRA over the recipe's fp32 masters, frozen, quantized by Recipe.forward in
    every forward (fp8_train_linear / fake_quant_int4), the recipe's dense training path."""
    model.requires_grad_(False)
    return LoRA(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, dtype=torch.float32, seed=seed)


def held(model) -> dict[str, torch.Tensor]:
    """The quantized base's tensors (codes and scales) under the payload's names."""
    return {f"{name}.{b}": getattr(m, b) for name, m in model.named_modules() if isinstance(m, QuantLinear)
            for b in m.buffer_names()}


@pytest.mark.parametrize("quant", ["fp8", "fp8_w8a16", "int4"])
def test_fresh_adapter_gives_the_recipes_logprobs_exactly(ckpt, batch, quant):
    plain = trainer(ckpt, recipe(quant), lora=LoRACfg()).logprobs(batch)
    assert torch.equal(trainer(ckpt, recipe(quant)).logprobs(batch), plain)
    fp32 = trainer(ckpt, PrecisionCfg(name="fp32"), lora=LoRACfg()).logprobs(batch)
    assert (plain - fp32).abs().max() > 1e-3  # the quantization is real


@pytest.mark.parametrize("quant", ["fp8", "fp8_w8a16", "int4"])
def test_a_step_moves_the_adapters_as_lora_over_the_dense_masters(ckpt, batch, quant, monkeypatch):
    """The straight-through backward through the held codes is the recipe's own (fp8_train_linear's,
    fake_quant_int4's): one SGD step (linear in the gradient) gives the adapters LoRA over the
    recipe's fp32 masters gives, bit for bit."""
    q = trainer(ckpt, recipe(quant), optimizer="sgd")
    with monkeypatch.context() as m:
        m.setattr(lora_side, "attach", dense_base_attach)
        dense = trainer(ckpt, recipe(quant), optimizer="sgd")
    assert not any(isinstance(m, QuantLinear) for m in dense.model.modules())
    mq, md = q.train_rl(batch), dense.train_rl(batch)
    assert mq["train/ppo_kl"] == 0.0 and mq["train/grad_norm"] > 0
    assert mq["train/grad_norm"] == md["train/grad_norm"]
    assert all(torch.equal(q.lora.tensors()[name], t) for name, t in dense.lora.tensors().items())
    assert torch.equal(q.logprobs(batch), dense.logprobs(batch))


@pytest.mark.parametrize("quant", ["fp8", "fp8_w8a16", "int4"])
def test_recompute_gives_the_same_adapters(ckpt, batch, quant):
    """trainer.recompute=true: each layer's backward recomputes the product with the held codes."""
    stored, recomputed = trainer(ckpt, recipe(quant)), trainer(ckpt, recipe(quant), recompute=True)
    assert stored.train_rl(batch) == recomputed.train_rl(batch)
    assert all(torch.equal(recomputed.lora.tensors()[name], t) for name, t in stored.lora.tensors().items())


@pytest.mark.parametrize("quant,codes,scale_shape", [("fp8", torch.float8_e4m3fn, (2, 1)),
                                                     ("int4", torch.uint8, (256, 1))])
def test_base_is_held_quantized_and_never_changes(ckpt, batch, quant, codes, scale_shape):
    t = trainer(ckpt, recipe(quant))
    up = t.model.layers[0].mlp.up_proj  # [256, 128]
    assert isinstance(up, FrozenQuantLinear) and [n for n, _ in up.named_parameters()] in ([], ["bias"])
    first, scale = (getattr(up, b) for b in up.buffer_names())
    assert first.dtype == codes and scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape
    assert first.shape == ((256, 128) if quant == "fp8" else (256, 64))  # int4: two codes per byte
    # Every projection held so, at 1 byte (fp8) or 1/2 byte (int4) a weight plus fp32 scales; no fp32 copy.
    projections = [m for m in t.model.modules() if isinstance(m, FrozenQuantLinear)]
    assert len(projections) == 2 * 7
    weights = sum(m.in_features * m.out_features for m in projections)
    scales = sum(getattr(m, m.buffer_names()[1]).numel() for m in projections)
    assert sum(m.held_bytes() for m in projections) == weights * (1 if quant == "fp8" else 0.5) + 4 * scales
    assert all(p.dim() < 2 or name.startswith(("embed_tokens.", "lm_head.")) for name, p in t.model.named_parameters())
    # The engine holds the same bits.
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), DType.bf16, seed=0, precision=recipe(quant), lora=LORA8)
    assert rollout_checksum(held(engine.model)) == rollout_checksum(held(t.model))
    before = {k: v.clone() for k, v in held(t.model).items()}
    t.train_rl(batch)
    assert all(torch.equal(held(t.model)[k], v) for k, v in before.items())
    assert any(b.abs().sum() > 0 for b in t.lora.lora_B)
    assert len(t.optimizer.state) == len(list(t.lora.parameters())) == 2 * len(t.lora.names)


@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_only_adapters_travel_and_the_engine_matches_the_trainer(ckpt, batch, quant):
    precision = recipe(quant, "fp32")
    t = trainer(ckpt, precision)
    t.train_rl(batch)
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), DType.fp32, seed=0, precision=precision, lora=LORA8)
    weights, digest = t.get_weights()
    assert set(weights) == set(t.lora.tensors())
    sent = sum(w.numel() * w.element_size() for w in weights.values())
    linears = [t.model.get_submodule(n) for n in t.lora.names]
    assert sent == sum(8 * (m.in_features + m.out_features) * 4 for m in linears)
    before = rollout_checksum(held(engine.model))
    assert engine.update_weights(weights, digest) == digest
    assert rollout_checksum(held(engine.model)) == before  # the base does not travel
    synced = batch_of(engine, PROMPTS[:2], LABELS[:2])
    mask = synced.loss_mask.bool()
    diff = (t.logprobs(synced) - synced.rollout_logprobs)[mask].abs().max().item()
    assert diff < 1e-5  # the recipes' fp32 logits are bitwise equal without LoRA (tests/unit/precision/test_recipe.py)
    base = trainer(ckpt, precision, lora=LoRACfg()).logprobs(synced)  # what an engine without the adapters scores
    assert (base - synced.rollout_logprobs)[mask].abs().max().item() > 1e-2


def test_resume_is_exact_and_refuses_another_base(ckpt, batch, tmp_path):
    a = trainer(ckpt, recipe("fp8"))
    a.train_rl(batch)
    a.save_state(str(tmp_path / "ck"))
    b = trainer(ckpt, recipe("fp8"))
    b.load_state(str(tmp_path / "ck"))
    assert a.train_rl(batch) == b.train_rl(batch)
    assert all(torch.equal(a.lora.tensors()[k], v) for k, v in b.lora.tensors().items())
    other = trainer(ckpt, recipe("int4"))  # holds another quantization of the base than model/ saved
    with pytest.raises(RuntimeError, match="differs from the frozen base"):
        other.load_state(str(tmp_path / "ck"))


def test_merged_export_is_the_dequantized_base_plus_the_adapter(ckpt, batch, tmp_path):
    """int4 in fp32: the held product is F.linear on the dequantized weight, so the dense export
    computes the trainer's log-probs (the merge's fp32 rounding aside)."""
    t = trainer(ckpt, recipe("int4", "fp32"))
    t.train_rl(batch)
    t.save(str(tmp_path / "final"))
    assert (tmp_path / "final/adapter/adapter_model.safetensors").is_file()
    merged = trainer(str(tmp_path / "final"), PrecisionCfg(name="fp32"), lora=LoRACfg())
    torch.testing.assert_close(merged.logprobs(batch), t.logprobs(batch), atol=1e-5, rtol=0)


def test_kl_reference_is_the_quantized_base(ckpt, batch):
    t = trainer(ckpt, recipe("fp8"), kl_coef=0.1)
    assert any(isinstance(m, FrozenQuantLinear) for m in t.ref_model.modules())
    assert torch.equal(t.update.full_logprobs(t.ref_model, batch), t.logprobs(batch))  # a fresh adapter: the base


def test_merging_into_a_quantized_engine_base_is_refused(ckpt):
    with pytest.raises(ValueError, match="cannot hold W \\+ alpha / rank \\* B A exactly"):
        NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), DType.bf16, seed=0, precision=recipe("fp8"),
                     lora=LoRACfg(rank=8, merge_in_engine=True))


def test_several_adapters_over_the_quantized_base(ckpt):
    """trainer.lora.adapters: the engine routes each prompt to its adapter over the same held codes,
    and the trainer's log-probs of the mixed batch equal the engine's after a sync."""
    lora = LoRACfg(rank=8, alpha=16.0, adapters=["add", "mul"], adapter_key="k")
    precision = recipe("int4", "fp32")
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), DType.fp32, seed=0, precision=precision, lora=lora)
    samples = engine.generate(PROMPTS, LABELS, n=4, adapters=[0, 1, 0, 1])
    adv = get(ADVANTAGES, "a", "grpo")(torch.tensor([float(i % 3 == 0) for i in range(16)]),
                                        torch.tensor([s.group for s in samples]))
    t = trainer(ckpt, precision, lora=lora)
    metrics = t.train_rl(build_train_batch(samples, adv, engine.pad_id))
    assert metrics["train/grad_norm/add"] > 0 and metrics["train/grad_norm/mul"] > 0
    engine.update_weights(*t.get_weights())
    mixed = engine.generate(PROMPTS, LABELS, n=2, adapters=[1, 0, 1, 0])
    batch = build_train_batch(mixed, torch.zeros(len(mixed)), engine.pad_id)
    mask = batch.loss_mask.bool()
    assert (t.logprobs(batch) - batch.rollout_logprobs)[mask].abs().max().item() < 1e-5


def test_moe_experts_and_the_projections_held_quantized(tmp_path):
    """Stacked MoE experts are held quantized beside the attention projections (FrozenQuantExperts,
    no fp32 copy); a fresh adapter still gives the recipe's log-probs exactly."""
    from miles.models.config import MoEConfig
    from miles.models.frozen_experts import FrozenQuantExperts

    model = ModelCfg(name="m", family="qwen3_moe", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                     moe=MoEConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32))
    ckpt = str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path))
    batch = batch_of(NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0), PROMPTS[:2], LABELS[:2])
    t = trainer(ckpt, recipe("fp8"))
    layer = t.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, FrozenQuantLinear)
    assert isinstance(layer.mlp.experts, FrozenQuantExperts) and layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert torch.equal(t.logprobs(batch), trainer(ckpt, recipe("fp8"), lora=LoRACfg()).logprobs(batch))
