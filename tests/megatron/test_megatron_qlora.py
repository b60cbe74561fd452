"""QLoRA on the Megatron-core trainer (trainer.lora under precision=int4_qat and fp8, fp8_scheme w8a16)
against the torch trainer's QLoRA (miles/precision/qlora.py), on the CPU (CUDA mapped to the CPU:
cuda_on_cpu.py), fp32:

- the frozen base is the recipe's INT4 / FP8 round trip (FP8: 128 x 128 blocks of the native tensors,
  stacked experts per expert), taken once at build: bit for bit the torch trainer's dequantized base,
  and a fresh adapter gives the recipe's trainer's log-probs without LoRA (its per-forward fake
  quantization / FP8 round trip) exactly; not the unquantized base's;
- adapters with values give the torch trainer's QLoRA log-probs, not LoRA over the unquantized base's;
- the first step (loss, grad norm, the adapters after Adam) is the torch trainer's; the base stays
  as it was, Megatron's DDP and optimizer hold the adapters only;
- the sync payload is the adapters only, with the torch trainer's checksum (in-process too);
- dense (qwen3) and MoE with expert adapters (qwen3_moe); a bf16 base is that round trip rounded to bf16;
- the linears hold the engine's INT4 / FP8 codes (policy and KL reference; FP8 where a fused weight's
  blocks are the native blocks), through resume and offload; the memory plan counts what is held."""

import pytest
import torch

from test_megatron_cuda import MEAN_TOL, _batch, _checkpoint, _diff  # noqa: E402  (tests/gpu helpers)
from test_megatron_lora import (LR, TARGETS, _assert_only_adapters_train, _assert_sync_and_first_step_as_torch, _cfgs,
                                _masked_max, _megatron, _randomize)

# Max |log-prob difference| to the torch trainer's QLoRA (measured: 0 on qwen3_tiny, 4.8e-7 on qwen3_moe_tiny).
TOL = 1e-5


RECIPES = ["int4_qat", "fp8"]


def _qlora(recipe: str, targets=None, dtype: str = "fp32"):
    """(algo, trainer, precision) of int4_qat (groups of 32) or fp8 (w8a16) in `dtype`: LoRA on
    `targets`, or none."""
    from miles.config.schema import DType, FP8Scheme, PrecisionCfg, Quant

    algo, cfg, _ = _cfgs(targets or ["q_proj"], rank=4 if targets else 0)
    quant = "int4" if recipe == "int4_qat" else "fp8"
    extra = {"fp8_scheme": FP8Scheme.w8a16} if quant == "fp8" else {}
    return algo, cfg, PrecisionCfg(name=recipe, train_dtype=DType(dtype), rollout_dtype=DType(dtype),
                                   train_quant=Quant(quant), rollout_quant=Quant(quant), int4_group_size=32, **extra)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_qlora_equals_the_torch_trainers_qlora(name, recipe, tmp_path, megatron_on_this_device):
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    ckpt, device = _checkpoint(name, tmp_path), megatron_on_this_device
    mega = MegatronTrainer(ckpt, *_qlora(recipe, TARGETS[name]), device=device, threads=1)
    native = TorchTrainer(ckpt, *_qlora(recipe, TARGETS[name]), device="cpu", threads=1)
    assert not mega._qat_rows  # nothing left for the forward to fake-quantize: the base was rounded once
    ours, theirs = mega.lora.tensors(), native.lora.tensors()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k].cpu(), theirs[k]) for k in theirs)
    if "moe" in name:
        assert any(".experts." in k for k in ours)

    base = mega._policy_state()  # the held base: the torch trainer's dequantized codes, bit for bit
    held = native.model.state_dict()
    assert all(torch.equal(base[k].cpu(), held[k].cpu()) for k in base)
    assert all(p.dtype == torch.float32 and not p.requires_grad for n, p in mega.model.module.named_parameters()
               if "miles_lora" not in n)

    batch = _batch(mega.arch.vocab_size)
    mask = batch.loss_mask
    fresh = mega.logprobs(batch)
    qat = MegatronTrainer(ckpt, *_qlora(recipe), device=device, threads=1)  # round trip at every forward
    assert qat._qat_rows and qat.fp8 == (recipe == "fp8")
    assert _masked_max(fresh, qat.logprobs(batch), mask) == 0.0  # rounded once == rounded each forward
    worst, mean = _diff(fresh, native.logprobs(batch), mask)
    print(f"\n{name} {recipe} QLoRA, fresh adapter vs trainer=torch QLoRA: log-probs max {worst:.3g} mean {mean:.3g}")
    assert worst < TOL and mean < MEAN_TOL["fp32"], (worst, mean)

    dense = _megatron(ckpt, device, TARGETS[name])  # LoRA over the unquantized base
    assert _masked_max(fresh, dense.logprobs(batch), mask) > 1e-3  # the quantization is real
    _randomize(mega.lora, native.lora, dense.lora)
    adapted = mega.logprobs(batch)
    worst, mean = _diff(adapted, native.logprobs(batch), mask)
    assert worst < TOL and mean < MEAN_TOL["fp32"], (worst, mean)
    assert _masked_max(adapted, fresh, mask) > 1e-2  # the adapters act
    assert _masked_max(adapted, dense.logprobs(batch), mask) > 1e-3  # over the quantized base

    m, n, moved = _assert_sync_and_first_step_as_torch(mega, native, batch, ours, theirs)
    print(f"{name} {recipe} QLoRA: adapted log-probs max {worst:.3g} mean {mean:.3g}; after a step adapters max "
          f"{float(moved.max()):.3g} mean {float(moved.mean()):.3g}; loss {m['train/loss']:.6f} / "
          f"{n['train/loss']:.6f}, grad norm {m['train/grad_norm']:.6f} / {n['train/grad_norm']:.6f}")
    assert float(moved.max()) <= 2.5 * LR and float(moved.mean()) < 1e-6, (float(moved.max()), float(moved.mean()))
    state = mega._policy_state()
    assert all(torch.equal(state[k], base[k]) for k in base)  # the base never changes
    _assert_only_adapters_train(mega)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_bf16_base_is_the_round_trip_rounded_once(recipe, tmp_path, megatron_on_this_device):
    """bf16: the base is rounded from the fp32 checkpoint's round trip (what the torch trainer's QLoRA
    multiplies under bf16 autocast: its codes dequantized to bf16), not from a bf16 copy."""
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    mega = MegatronTrainer(ckpt, *_qlora(recipe, TARGETS["qwen3_tiny"], "bf16"), device=megatron_on_this_device,
                           threads=1)
    held = TorchTrainer(ckpt, *_qlora(recipe, TARGETS["qwen3_tiny"]), device="cpu", threads=1).model.state_dict()
    matrices = {k: v for k, v in mega._policy_state().items() if v.dim() >= 2}
    assert matrices and all(v.dtype == torch.bfloat16 for v in matrices.values())
    assert all(torch.equal(v.cpu(), held[k].to(torch.bfloat16)) for k, v in matrices.items())


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("name", ["qwen3_tiny", "deepseek_v3_tiny"])
def test_the_plan_counts_what_the_trainer_holds(name, recipe, compose, tmp_path, megatron_on_this_device):
    """The plan's weights are what Megatron's QLoRA trainer holds (fp32 here): the linears' INT4 / FP8
    codes and scales (trainer=torch's count of them) and the rest dense, under fp8 the fused weights
    whose blocks mix native blocks too (qwen3_tiny's linear_qkv, head_dim 32; deepseek_v3_tiny's
    gate/up where their width is not a multiple of 128)."""
    from miles.hardware.footprint import param_groups
    from miles.hardware.planner import TrainLayout, train_usage
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.trainer.megatron.held_base import held_tensors
    from miles.trainer.megatron.trainer import MegatronTrainer

    run = [f"model={name}", f"precision={recipe}", "precision.train_dtype=fp32", "precision.rollout_dtype=fp32",
           "trainer.lora.rank=8", "trainer.micro_batch_size=4", "trainer.pack_sequences=false"]
    cfg = compose([*run, "trainer=megatron"])
    ckpt = random_checkpoint(cfg.model, "0123456789+=", 0, tmp_path)
    mega = MegatronTrainer(str(ckpt), cfg.algo, cfg.trainer, cfg.precision, device=megatron_on_this_device, threads=1)
    model = mega.model.module
    dense = [p for n, p in model.named_parameters() if "miles_lora" not in n]
    dense += [b for n, b in model.named_buffers() if n.endswith("expert_bias")]  # DeepSeek's router bias
    codes = held_tensors(model)
    held = sum(t.numel() * t.element_size() for t in dense + codes)
    groups = param_groups(mega.arch, cfg.precision)
    planned = train_usage(cfg, groups, TrainLayout(1, 1, 1), gpus=1)["weights"]
    assert held == planned - mega.lora.num_bytes()
    total = (groups.embed + groups.dense + groups.routed) * 4
    if name == "qwen3_tiny":  # every fused linear holds codes, but under fp8 linear_qkv
        assert len(codes) == 2 * (4 if recipe == "int4_qat" else 3) * mega.arch.num_layers
        assert held < (0.45 if recipe == "int4_qat" else 0.55) * total
    # trainer=torch holds every projection's codes and the rest in fp32, as Megatron in fp32 does where
    # its blocks allow
    on_torch = train_usage(compose(run), groups, TrainLayout(1, 1, 1), gpus=1)["weights"]
    assert on_torch < planned if recipe == "fp8" else on_torch == planned  # fp8: some fused weights dense


def test_fp8_codes_where_the_blocks_align(tmp_path, megatron_on_this_device):
    """fp8 QLoRA with head_dim 128: linear_qkv's 128 x 128 blocks are the native q / k / v blocks, so
    every fused linear holds the engine's FP8 codes, which dequantize to the torch trainer's held base
    bit for bit; a fresh adapter gives trainer=torch's QLoRA log-probs."""
    import dataclasses

    from test_megatron_cuda import _model_cfg

    from miles.data.tokenizer import DEFAULT_ALPHABET
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.trainer.megatron.held_base import held_tensors
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    model = dataclasses.replace(_model_cfg("qwen3_tiny"), head_dim=128)
    ckpt = str(random_checkpoint(model, DEFAULT_ALPHABET, seed=0, out=tmp_path / "hd128"))
    mega = MegatronTrainer(ckpt, *_qlora("fp8", TARGETS["qwen3_tiny"]), device=megatron_on_this_device, threads=1)
    native = TorchTrainer(ckpt, *_qlora("fp8", TARGETS["qwen3_tiny"]), device="cpu", threads=1)
    codes = held_tensors(mega.model.module)
    assert len(codes) == 2 * 4 * mega.arch.num_layers
    assert {t.dtype for t in codes} == {torch.float8_e4m3fn, torch.float32}
    held = native.model.state_dict()
    assert all(torch.equal(v.cpu(), held[k].cpu()) for k, v in mega._policy_state().items())
    batch = _batch(mega.arch.vocab_size)
    worst, _ = _diff(mega.logprobs(batch), native.logprobs(batch), batch.loss_mask)
    assert worst < TOL


@pytest.mark.parametrize("recipe", RECIPES)
def test_recompute_steps_as_the_torch_trainers_qlora(recipe, tmp_path, megatron_on_this_device):
    """trainer.recompute under QLoRA: Megatron's full recompute re-runs each layer over the base held
    as its round trip (nothing swapped in per forward, so nothing to lose): the first step is the
    torch trainer's, recomputing too."""
    import dataclasses

    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    algo, cfg, precision = _qlora(recipe, TARGETS["qwen3_tiny"])
    cfg = dataclasses.replace(cfg, recompute=True)
    mega = MegatronTrainer(ckpt, algo, cfg, precision, device=megatron_on_this_device, threads=1)
    native = TorchTrainer(ckpt, algo, cfg, precision, device="cpu", threads=1)
    _randomize(mega.lora, native.lora)
    batch = _batch(mega.arch.vocab_size)
    m, n = mega.train_rl(batch), native.train_rl(batch)
    for key in ("train/loss", "train/grad_norm"):
        assert m[key] == pytest.approx(n[key], rel=1e-4, abs=1e-6), key
    assert m["train/grad_norm"] > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_codes_through_resume_offload_and_the_kl_reference(recipe, tmp_path, megatron_on_this_device):
    """bf16 QLoRA: the policy's and the KL reference's linears hold codes and no dense weight (fp8:
    but linear_qkv, see above); a resumed trainer and an offloaded-and-onloaded one continue bit for
    bit; a checkpoint whose base differs from the codes is refused on load."""
    import dataclasses

    from miles.trainer import offload
    from miles.trainer.megatron.held_base import held_tensors
    from miles.trainer.megatron.trainer import MegatronTrainer

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    algo, cfg, precision = _qlora(recipe, TARGETS["qwen3_tiny"], "bf16")
    algo = dataclasses.replace(algo, kl_coef=0.1)
    held_linears = ("linear_fc1", "linear_proj", "linear_fc2") + (("linear_qkv",) if recipe == "int4_qat" else ())

    def build():
        return MegatronTrainer(ckpt, algo, cfg, precision, device=megatron_on_this_device, threads=1)

    first = build()
    for model in (first.model.module, first.ref_model):
        codes = held_tensors(model)
        assert len(codes) == 2 * len(held_linears) * first.arch.num_layers
        assert {t.dtype for t in codes} == {torch.uint8 if recipe == "int4_qat" else torch.float8_e4m3fn, torch.float32}
        assert not any(n.endswith(tuple(f"{m}.weight" for m in held_linears)) for n, _ in model.named_parameters())
    batch = _batch(first.arch.vocab_size)
    _randomize(first.lora)
    before = {k: v.clone() for k, v in first._policy_state().items()}
    metrics = first.train_rl(batch)
    assert metrics["train/kl_ref"] > 0.0  # the reference (the frozen base without adapters) is read
    assert all(torch.equal(v, before[k]) for k, v in first._policy_state().items())

    first.save_state(str(tmp_path / "state"))
    expected = first.train_rl(batch)
    second = build()
    second.load_state(str(tmp_path / "state"))
    assert second.train_rl(batch) == expected

    sizes = second.offload_bytes()
    offload.FORCE_COPY = True  # on the CPU too, the tensors move (fresh copies)
    try:
        second.offload()
        assert second.offload_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
        assert all(t.device.type == "cpu" and (t.is_pinned() or not torch.cuda.is_available())
                   for t in held_tensors(second.model.module))
        second.onload()
    finally:
        offload.FORCE_COPY = False
    assert sizes["params"] >= sum(t.numel() * t.element_size() for t in held_tensors(second.model.module))
    assert second.train_rl(batch) == first.train_rl(batch)

    saved = torch.load(tmp_path / "state/megatron.pt", weights_only=False)
    key = next(k for k in saved["model"] if k.endswith("linear_fc2.weight"))
    saved["model"][key] = saved["model"][key].float().mul(1.01).to(torch.bfloat16)
    torch.save(saved, tmp_path / "state/megatron.pt")
    with pytest.raises(RuntimeError, match="differs from the frozen base this trainer holds as codes"):
        build().load_state(str(tmp_path / "state"))
