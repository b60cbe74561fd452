"""The Megatron-core trainer against the native trainer on the CPU (CUDA mapped to the CPU:
tests/megatron/cuda_on_cpu.py): log-probs of the same weights for a dense, a biased and an MoE family,
the weight round trip through a real GPTModel and the first step, the KL reference, save / resume.
tests/gpu/test_megatron_cuda.py runs the same checks on the H200 (plus bf16 and a 20-step GRPO run)."""

import pytest
import torch

from test_megatron_cuda import MEAN_TOL, TOL, _batch, _checkpoint, _diff  # noqa: E402  (tests/gpu helpers)


def _trainers(ckpt: str, device: str, kl_coef: float = 0.0, dtype: str = "fp32"):
    from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, TrainerCfg
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    cfg = TrainerCfg(lr=1e-4, global_batch_size=8, micro_batch_size=4, pack_sequences=False)
    precision = PrecisionCfg(name=dtype, train_dtype=DType(dtype), rollout_dtype=DType(dtype))
    algo = AlgoCfg(name=AlgoName.grpo, kl_coef=kl_coef)
    return (MegatronTrainer(ckpt, algo, cfg, precision, device=device, threads=1),
            TorchTrainer(ckpt, algo, cfg, precision, device=device, threads=1))


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen2_5_tiny", "qwen3_moe_tiny"])
def test_logprobs_equal_the_native_trainer(name, tmp_path, megatron_on_this_device):
    mega, native = _trainers(_checkpoint(name, tmp_path), megatron_on_this_device)
    batch = _batch(mega.arch.vocab_size)
    worst, mean = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    assert worst < TOL["fp32"] and mean < MEAN_TOL["fp32"], (worst, mean)


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_weights_round_trip_and_the_first_step(name, tmp_path, megatron_on_this_device):
    """get_weights returns the checkpoint's tensors bit for bit; the first step has ppo_kl == 0 and
    the native trainer's loss, grad norm and updated weights (Adam, fp32)."""
    ckpt = _checkpoint(name, tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device)
    assert_project_norms(mega.model, layers=mega.arch.num_layers, per_layer=4)  # input, pre-MLP, q, k
    assert_round_trip_and_first_step(ckpt, mega, native)


def assert_project_norms(model, layers: int, per_layer: int) -> None:
    """Every RMSNorm megatron-core built from the local spec is the project's (compiled on CUDA,
    miles/trainer/megatron/specs.py): `per_layer` in each layer and the final one, none of torch's."""
    from miles.trainer.megatron.specs import SpecRMSNorm

    kinds = [type(m) for m in model.modules()]
    assert torch.nn.RMSNorm not in kinds
    assert kinds.count(SpecRMSNorm) == layers * per_layer + 1


def assert_round_trip_and_first_step(ckpt: str, mega, native) -> tuple[dict, dict]:
    """get_weights gives the checkpoint bit for bit; the first step has ppo_kl == 0 and the native
    trainer's loss, grad norm and updated weights. Returns both steps' metrics."""
    from miles.models import from_pretrained

    weights, _ = mega.get_weights()
    reference = from_pretrained(ckpt, dtype=torch.float32).state_dict()
    assert set(weights) == set(reference)
    assert all(torch.equal(weights[k].cpu(), reference[k]) for k in reference)
    batch = _batch(mega.arch.vocab_size)
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)
    after, _ = mega.get_weights()
    moved = native.model.state_dict()
    diffs = torch.cat([(after[k].cpu() - moved[k].cpu()).abs().flatten() for k in moved])
    # Adam's first step moves each weight by ~lr * sign(grad): where a gradient is ~0 its sign may
    # differ between the two (fp32 rounding), a step of at most 2 lr; everywhere else they agree.
    assert float(diffs.max()) <= 2.5e-4 and float(diffs.mean()) < 1e-7, (float(diffs.max()), float(diffs.mean()))
    return after, moved


def test_kl_reference_is_a_frozen_copy_of_the_start(tmp_path, megatron_on_this_device):
    mega, native = _trainers(_checkpoint("qwen3_tiny", tmp_path), megatron_on_this_device, kl_coef=0.1)
    batch = _batch(mega.arch.vocab_size)
    assert float(mega.kl_to_ref(batch).abs().max()) == 0.0
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/kl_ref"] == pytest.approx(n["train/kl_ref"], abs=1e-9)
    mega.train_rl(batch)
    assert float(mega.kl_to_ref(batch).abs().sum()) > 0


def test_save_and_resume_continue_the_same_training(tmp_path, megatron_on_this_device):
    from miles.models import from_pretrained

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    first, _ = _trainers(ckpt, megatron_on_this_device, dtype="bf16")
    batch = _batch(first.arch.vocab_size)
    first.train_rl(batch)
    first.save_state(str(tmp_path / "state"))
    first.save(str(tmp_path / "hf"))
    expected = first.train_rl(batch)
    second, _ = _trainers(ckpt, megatron_on_this_device, dtype="bf16")
    second.load_state(str(tmp_path / "state"))
    got = second.train_rl(batch)
    assert got["train/loss"] == expected["train/loss"]
    assert got["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=1e-5)
    assert from_pretrained(tmp_path / "hf").config.num_layers == first.arch.num_layers
    # torch's fused AdamW (the native trainer's), before and after the resume: its step on the device
    for trainer in (first, second):
        for o in trainer._optimizers():
            assert all(g["fused"] and not g["foreach"] for g in o.optimizer.param_groups)
            assert all(s["step"].device == p.device for p, s in o.optimizer.state.items())


def test_bf16_offload_onload_continues_bit_for_bit(tmp_path, megatron_on_this_device):
    """bf16: the fp32 main parameters are the optimizer's own tensors (not views of the parameter
    buffers, as in fp32): offloading every tag and onloading gives the next step of a trainer that
    never offloaded, bit for bit; offload_bytes counts each tag, 0 once offloaded."""
    from miles.trainer import offload

    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    plain, _ = _trainers(ckpt, megatron_on_this_device, kl_coef=0.1, dtype="bf16")
    moved, _ = _trainers(ckpt, megatron_on_this_device, kl_coef=0.1, dtype="bf16")
    batch = _batch(plain.arch.vocab_size)
    plain.train_rl(batch), moved.train_rl(batch)
    sizes = moved.offload_bytes()
    assert all(sizes[tag] > 0 for tag in ("params", "grads", "optimizer")), sizes
    offload.FORCE_COPY = True  # the Adam moments move on the CPU too
    try:
        moved.offload()
        assert moved.offload_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
        with pytest.raises(RuntimeError, match="onload"):
            moved.train_rl(batch)
        moved.onload()
    finally:
        offload.FORCE_COPY = False
    assert moved.train_rl(batch) == plain.train_rl(batch)
    assert all(torch.equal(a, b) for a, b in zip(moved.get_weights()[0].values(), plain.get_weights()[0].values()))


@pytest.mark.slow
def test_compiled_fusions_as_on_cuda_equal_the_native_trainer(tmp_path, megatron_on_this_device, monkeypatch):
    """With the settings CUDA gets (megatron-core's torch.compile'd SwiGLU, the compiled RoPE / norms of
    miles/models/fused.py for both trainers), compiled here by Inductor's CPU backend: log-probs and the
    first step still equal the native trainer's (fp32)."""
    import miles.trainer.megatron.trainer as megatron_trainer
    from miles.models import fused

    monkeypatch.setattr(fused, "ops", fused._Ops(fused.EAGER))  # enable() fills this copy; restored after
    monkeypatch.setattr(megatron_trainer, "compiled_fusions", lambda device: True)
    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    mega, native = _trainers(ckpt, megatron_on_this_device)
    assert mega.megatron_config.bias_activation_fusion and fused.ops["silu_mul"] is not fused.EAGER["silu_mul"]
    batch = _batch(mega.arch.vocab_size)
    worst, mean = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    assert worst < TOL["fp32"] and mean < MEAN_TOL["fp32"], (worst, mean)
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-3)
