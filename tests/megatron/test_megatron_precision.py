"""The precision recipes on the Megatron trainer against the native trainer on the CPU (CUDA mapped to
the CPU: cuda_on_cpu.py): INT4 QAT's fake-quantized forward and FP8 w8a16's (each weight the FP8 round
trip of its native parts: the same log-probs and first step; quantizing the fused Megatron weights
instead gives other weights), and the quantized sync payloads (INT4 and FP8 rollouts: bit for bit
the native trainer's, with the same checksum). fp32 master weights on both sides, so the two quantize
the same numbers."""


import pytest
import torch

from test_megatron_cuda import _batch, _checkpoint  # noqa: E402  (tests/gpu helpers)

RECIPES = {  # name: (train_quant, rollout_quant)
    "int4_qat": ("int4", "int4"),
    "fp32_train_int4_rollout": ("none", "int4"),
    "fp32_train_fp8_rollout": ("none", "fp8"),
    "fp8": ("fp8", "fp8"),  # fp8_scheme w8a16 (fp8's default): FP8 weights, high-precision activations
}


def _trainers(ckpt: str, device: str, recipe: str, recompute: bool = False, **precision):
    from miles.config.schema import AlgoCfg, AlgoName, FP8Scheme, PrecisionCfg, Quant, TrainerCfg
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    train, rollout = RECIPES[recipe]
    if recipe == "fp8":
        precision.setdefault("fp8_scheme", FP8Scheme.w8a16)
    cfg = TrainerCfg(lr=1e-4, global_batch_size=8, micro_batch_size=4, pack_sequences=False, recompute=recompute)
    precision = PrecisionCfg(name=recipe, train_quant=Quant(train), rollout_quant=Quant(rollout), int4_group_size=32,
                             **precision)
    args = (ckpt, AlgoCfg(name=AlgoName.grpo), cfg, precision)
    return (MegatronTrainer(*args, device=device, threads=1), TorchTrainer(*args, device=device, threads=1))


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_int4_qat_forward_and_step_equal_the_native_trainer(name, tmp_path, megatron_on_this_device):
    mega, native, batch = _trainers_with_the_native_log_probs(_checkpoint(name, tmp_path), megatron_on_this_device,
                                                              "int4_qat", "fp32_train_int4_rollout")
    _assert_first_step_as_native(mega, native, batch)


def _trainers_with_the_native_log_probs(ckpt, device, recipe: str, plain_recipe: str):
    """Both trainers of `recipe`, checked to give the same log-probs on a batch, which the recipe's
    quantization moves (against `plain_recipe`'s unquantized forward): (mega, native, batch)."""
    mega, native = _trainers(ckpt, device, recipe)
    assert mega._qat_rows, f"no Megatron weight is quantized under {recipe}"
    batch = _batch(mega.arch.vocab_size)
    got, want = mega.logprobs(batch).cpu(), native.logprobs(batch).cpu()
    assert float(((got - want).abs() * batch.loss_mask).max()) < 1e-4
    plain, _ = _trainers(ckpt, device, plain_recipe)
    assert float(((got - plain.logprobs(batch).cpu()).abs() * batch.loss_mask).max()) > 1e-3
    return mega, native, batch


def _assert_first_step_as_native(mega, native, batch) -> None:
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


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_fp8_w8a16_forward_step_and_payload_equal_the_native_trainer(name, tmp_path, megatron_on_this_device):
    mega, native, batch = _trainers_with_the_native_log_probs(_checkpoint(name, tmp_path), megatron_on_this_device,
                                                              "fp8", "fp32_train_fp8_rollout")
    (payload, checksum), (want_payload, want_checksum) = mega.get_weights(), native.get_weights()
    assert checksum == want_checksum
    assert sorted(payload) == sorted(want_payload)
    assert all(torch.equal(payload[k], want_payload[k]) for k in want_payload)
    _assert_first_step_as_native(mega, native, batch)
    assert len(mega.recipe.fp8_cache) == 0, "the forward's FP8 weights outlive the train step"
    # after the step: the new weights' round trip, still the native trainer's log-probs (the two
    # optimizers' fp32 weights differ in their last bits, ~4e-7, so the FP8 payloads need not be equal now)
    got, want = mega.logprobs(batch).cpu(), native.logprobs(batch).cpu()
    assert float(((got - want).abs() * batch.loss_mask).max()) < 1e-4


def test_fp8_blocks_are_the_native_tensors_not_the_fused_rows(tmp_path, megatron_on_this_device):
    """The mapping matters: FP8 blocks of GPTModel's fused q/k/v and gate/up weights are not the native
    tensors' blocks, so quantizing the fused weights directly gives other weights (and log-probs)."""
    from miles.precision.fake_quant import fake_quant_fp8_weight
    from miles.trainer.megatron.quant import fp8_round_trip

    mega, _ = _trainers(_checkpoint("qwen3_tiny", tmp_path), megatron_on_this_device, "fp8")
    state = mega.model.module.state_dict()
    ours = fp8_round_trip(state, list(mega._qat_rows), mega.recipe, mega.arch, mega.te)
    # q / k / v interleaved per query group (q 128 rows, k and v 64 each): the fused blocks mix them
    fused = [n for n in ours if "linear_qkv" in n]
    assert fused and all(not torch.equal(ours[n], fake_quant_fp8_weight(state[n].detach())) for n in fused)
    # unfused, or (gate / up: 384 rows each) fused along whole blocks: the same either way
    plain = [n for n in ours if "linear_qkv" not in n]
    assert plain and all(torch.equal(ours[n], fake_quant_fp8_weight(state[n].detach())) for n in plain)
    batch = _batch(mega.arch.vocab_size)
    got = mega.logprobs(batch).cpu()
    naive = {"module." + n: fake_quant_fp8_weight(state[n].detach()) for n in mega._qat_rows}
    mega.recipe.fp8_cache.weights = lambda *args, **kwargs: naive
    assert float(((got - mega.logprobs(batch).cpu()).abs() * batch.loss_mask).max()) > 1e-3


@pytest.mark.parametrize("recipe", ["int4_qat", "fp8"])
def test_recompute_steps_on_the_forwards_round_trips(recipe, tmp_path, megatron_on_this_device, monkeypatch):
    """trainer.recompute=true: Megatron's full recompute re-runs each layer in backward after the
    forward that swapped in the round-tripped weights has ended; the layers' noted weights make the
    step the stored-activation step's, bit for bit. Without them (negative control) the recomputation
    multiplies the fp32 masters and the gradients differ."""
    from miles.trainer import held_weights

    ckpt, device = _checkpoint("qwen3_tiny", tmp_path), megatron_on_this_device

    def step(recompute: bool):
        mega, _ = _trainers(ckpt, device, recipe, recompute=recompute)
        metrics = mega.train_rl(_batch(mega.arch.vocab_size))
        if recompute:  # the notes (the forward's round-trip tensors) are dropped when the step ends
            assert all(noted.state is None for noted in mega._recompute_notes._layers)
        return metrics, mega._policy_state()

    (stored, weights), (recomputed, again) = step(False), step(True)
    assert stored["train/grad_norm"] == recomputed["train/grad_norm"] and stored["train/loss"] == recomputed["train/loss"]
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    monkeypatch.setattr(held_weights, "_put", lambda state: None)
    assert step(True)[0]["train/grad_norm"] != stored["train/grad_norm"]
