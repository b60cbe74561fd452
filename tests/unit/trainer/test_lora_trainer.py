"""LoRA on the torch trainer and the native engine (trainer.lora.rank > 0), in-process.

Real values: a fresh adapter gives the base model's log-probs exactly; a step changes only the
adapters (no optimizer state for the base); the sync carries the adapters only (<= 5% of the model's
bytes at rank 8), and the engine then holds what the trainer sent (checksum) and samples with the
trainer's log-probs; resume restores the adapters and the optimizer exactly; the merged export
equals the adapted model.
"""

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, PrecisionCfg, RolloutCfg, TrainerCfg
from miles.rollout.native import NativeEngine
from miles.transport.checksum import WeightSyncError
from miles.trainer.torch_trainer import TorchTrainer

FP32 = PrecisionCfg(name="fp32")
LORA8 = LoRACfg(rank=8, alpha=16.0)


def _trainer(ckpt, lora=LORA8, lr=1e-2):
    return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(lr=lr, global_batch_size=16, micro_batch_size=4,
                                                                       lora=lora), FP32)


def test_fresh_adapter_gives_the_base_logprobs_exactly(ckpt, rollout_batch):
    base = _trainer(ckpt, lora=LoRACfg()).logprobs(rollout_batch)
    assert torch.equal(_trainer(ckpt).logprobs(rollout_batch), base)


def test_a_step_trains_only_the_adapters(ckpt, rollout_batch):
    trainer = _trainer(ckpt)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_rl(rollout_batch)
    assert m["train/ppo_kl"] == 0.0 and m["train/grad_norm"] > 0
    assert all(torch.equal(trainer.model.state_dict()[k], v) for k, v in before.items())  # base frozen
    assert not any(p.requires_grad for p in trainer.model.parameters())
    assert any(b.abs().sum() > 0 for b in trainer.lora.lora_B)  # B moved off zero
    state = trainer.optimizer.state
    assert len(state) == len(list(trainer.lora.parameters())) == 2 * len(trainer.lora.names)


def test_sync_carries_the_adapters_and_the_engine_matches(ckpt, rollout_batch):
    trainer = _trainer(ckpt)
    trainer.train_rl(rollout_batch)
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=5), seed=0, lora=LORA8)
    weights, digest = trainer.get_weights()
    # rank x (in + out) fp32 numbers per adapted projection, nothing else (the 5% bound at a real
    # width: tests/unit/models/test_lora.py; this model is 32 wide).
    sent = sum(t.numel() * t.element_size() for t in weights.values())
    linears = [trainer.model.get_submodule(n) for n in trainer.lora.names]
    assert set(weights) == set(trainer.lora.tensors())
    assert sent == sum(8 * (m.in_features + m.out_features) * 4 for m in linears)
    assert engine.update_weights(weights, digest) == digest
    # The engine's log-probs of its own samples are the trainer's (fp32 rounding).
    samples = engine.generate(["1+2=", "33+4="], ["3", "37"], n=4)
    from miles.types import build_train_batch

    batch = build_train_batch(samples, torch.zeros(len(samples)), engine.pad_id)
    mask = batch.loss_mask.bool()
    diff = (trainer.logprobs(batch) - batch.rollout_logprobs)[mask].abs().max().item()
    assert diff < 1e-5
    # In-process: the same adapters on the trainer's device, the same checksum.
    flat, digest2 = trainer.get_weights(in_process=True)
    assert digest2 == digest and engine.update_weights(flat, digest2) == digest
    with pytest.raises(WeightSyncError):
        engine.update_weights(weights, "0" * 64)


def test_resume_restores_adapters_and_optimizer_exactly(ckpt, rollout_batch, tmp_path):
    a = _trainer(ckpt)
    a.train_rl(rollout_batch)
    a.save_state(str(tmp_path / "ck"))
    assert (tmp_path / "ck/adapter/adapter_config.json").is_file()
    b = _trainer(ckpt)
    b.load_state(str(tmp_path / "ck"))
    ma, mb = a.train_rl(rollout_batch), b.train_rl(rollout_batch)
    assert ma == mb
    assert all(torch.equal(a.lora.tensors()[k], v) for k, v in b.lora.tensors().items())


def test_merged_export_is_the_adapted_model(ckpt, rollout_batch, tmp_path):
    trainer = _trainer(ckpt)
    trainer.train_rl(rollout_batch)
    adapted = trainer.logprobs(rollout_batch)
    trainer.save(str(tmp_path / "final"))
    assert (tmp_path / "final/adapter/adapter_model.safetensors").is_file()
    merged = TorchTrainer(str(tmp_path / "final"), AlgoCfg(name=AlgoName.grpo),
                          TrainerCfg(global_batch_size=16, micro_batch_size=4), FP32)
    torch.testing.assert_close(merged.logprobs(rollout_batch), adapted, atol=1e-5, rtol=0)
    assert torch.equal(trainer.logprobs(rollout_batch), adapted)  # the trainer's own weights untouched


def test_bf16_base_is_held_in_bf16(ckpt, rollout_batch):
    prec = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(global_batch_size=16, micro_batch_size=8,
                                                                         lora=LORA8), prec)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.lora.parameters())
    m = trainer.train_rl(rollout_batch)
    assert m["train/ppo_kl"] == 0.0
    weights, _ = trainer.get_weights()
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
