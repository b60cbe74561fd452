"""The precision recipes on the Megatron trainer against the native trainer on the CPU (CUDA mapped to
the CPU: cuda_on_cpu.py): INT4 QAT's fake-quantized forward (the same log-probs and first step), and
the quantized sync payloads (INT4 and FP8 rollouts: bit for bit the native trainer's, with the same
checksum). fp32 master weights on both sides, so the two quantize the same numbers."""


import pytest
import torch

from test_megatron_cuda import _batch, _checkpoint  # noqa: E402  (tests/gpu helpers)

RECIPES = {  # name: (train_quant, rollout_quant)
    "int4_qat": ("int4", "int4"),
    "fp32_train_int4_rollout": ("none", "int4"),
    "fp32_train_fp8_rollout": ("none", "fp8"),
}


def _trainers(ckpt: str, device: str, recipe: str, **precision):
    from miles.config.schema import AlgoCfg, AlgoName, PrecisionCfg, Quant, TrainerCfg
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    train, rollout = RECIPES[recipe]
    cfg = TrainerCfg(lr=1e-4, global_batch_size=8, micro_batch_size=4, pack_sequences=False)
    precision = PrecisionCfg(name=recipe, train_quant=Quant(train), rollout_quant=Quant(rollout), int4_group_size=32,
                             **precision)
    args = (ckpt, AlgoCfg(name=AlgoName.grpo), cfg, precision)
    return (MegatronTrainer(*args, device=device, threads=1), TorchTrainer(*args, device=device, threads=1))


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_int4_qat_forward_and_step_equal_the_native_trainer(name, tmp_path, megatron_on_this_device):
    ckpt = _checkpoint(name, tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device, "int4_qat")
    assert mega._qat_rows, "no Megatron weight is fake-quantized"
    batch = _batch(mega.arch.vocab_size)
    got, want = mega.logprobs(batch).cpu(), native.logprobs(batch).cpu()
    assert float(((got - want).abs() * batch.loss_mask).max()) < 1e-4
    # the fake quantization acts: the recipe's log-probs are not the plain model's
    plain, _ = _trainers(ckpt, megatron_on_this_device, "fp32_train_int4_rollout")
    assert float(((got - plain.logprobs(batch).cpu()).abs() * batch.loss_mask).max()) > 1e-3
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)


def test_kept_rows_stay_unquantized(tmp_path, megatron_on_this_device):
    """keep_first_layers=1: layer 0's fused weights have no quantized row; a kept router is never marked."""
    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device, "int4_qat", keep_first_layers=1)
    assert not any(name.startswith("decoder.layers.0.") for name in mega._qat_rows)
    assert not any("router" in name or "embedding" in name or "output_layer" in name for name in mega._qat_rows)
    batch = _batch(mega.arch.vocab_size)
    assert float(((mega.logprobs(batch).cpu() - native.logprobs(batch).cpu()).abs() * batch.loss_mask).max()) < 1e-4


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_sync_payload_equals_the_native_trainers(recipe, tmp_path, megatron_on_this_device):
    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device, recipe)
    (got, got_sum), (want, want_sum) = mega.get_weights(), native.get_weights()
    assert got_sum == want_sum
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    (_, flat_sum), (_, native_flat_sum) = mega.get_weights(in_process=True), native.get_weights(in_process=True)
    assert flat_sum == native_flat_sum
