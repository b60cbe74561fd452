"""LoRA on the Megatron-core trainer (miles/trainer/megatron/lora.py) against the torch trainer's LoRA, on
the CPU (CUDA mapped to the CPU: cuda_on_cpu.py), fp32 unless named:

- the adapters are trainer=torch's (names, shapes, seeded values); a fresh adapter gives the base's
  log-probs exactly; adapters with values give the torch trainer's log-probs (and move them: the hooks act);
- the first step (loss, grad norm, the adapters after Adam) is the torch trainer's; the base is
  unchanged and Megatron's DDP and distributed optimizer hold the adapters only;
- the sync payload is the torch trainer's (names, shapes, checksum; in-process too);
- dense (qwen3), MoE with expert adapters (qwen3_moe), MLA with DeepSeek MoE (deepseek_v3);
- bf16: the base held in bf16, no optimizer state for it; resume and offload continue exactly;
- the export's adapter loads in PEFT on the transformers Qwen3 with the trainer's log-probs;
- several adapters (dense and on MoE experts): routed per row (per token into experts) and stepped each on its own as trainer=torch does (an adapter
  without samples in a step left as it was, its Adam state too);
- LoRA under precision=fp8 w8a8 is refused by name (its FP8 GEMMs need Transformer Engine); fp8 w8a16
  without LoRA trains (test_megatron_precision.py), QLoRA under int4_qat and fp8 w8a16: test_megatron_qlora.py."""

import pytest
import torch

from test_megatron_cuda import TOL, MEAN_TOL, _batch, _checkpoint, _diff  # noqa: E402  (tests/gpu helpers)

PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {"qwen3_tiny": PROJ, "qwen2_5_tiny": PROJ, "qwen3_moe_tiny": [*PROJ, "experts"],
           "deepseek_v3_tiny": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", *PROJ, "experts"]}
LR = 1e-3


def _lora_model_tests():
    """tests/unit/models/test_lora.py, for its transformers-saved tiny Qwen3 (the `hf_dir` fixture)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "unit" / "models" / "test_lora.py"
    spec = importlib.util.spec_from_file_location("unit_models_test_lora", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LORA_TESTS = _lora_model_tests()
hf_dir = _LORA_TESTS.hf_dir  # the fixture itself, reused


def _cfgs(targets, dtype: str = "fp32", rank: int = 4, **lora):
    from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, PrecisionCfg, TrainerCfg

    cfg = TrainerCfg(lr=LR, global_batch_size=8, micro_batch_size=4, pack_sequences=False,
                     lora=LoRACfg(rank=rank, alpha=2.0 * rank, target_modules=list(targets), **lora))
    precision = PrecisionCfg(name=dtype, train_dtype=DType(dtype), rollout_dtype=DType(dtype))
    return AlgoCfg(name=AlgoName.grpo), cfg, precision


def _megatron(ckpt, device, targets, dtype="fp32", **lora):
    from miles.trainer.megatron.trainer import MegatronTrainer

    return MegatronTrainer(ckpt, *_cfgs(targets, dtype, **lora), device=device, threads=1)


def _torch(ckpt, targets, dtype="fp32", **lora):
    from miles.trainer.torch_trainer import TorchTrainer

    return TorchTrainer(ckpt, *_cfgs(targets, dtype, **lora), device="cpu", threads=1)


@torch.no_grad()
def _randomize(*loras, seed: int = 3) -> None:
    """The same random A and B (as if trained) into each LoRA, by name."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in loras[0].tensors().items():
        value = torch.randn(p.shape, generator=gen) * 0.1
        for lora in loras:
            lora.tensors()[name].copy_(value)


def _masked_max(a, b, mask) -> float:
    return float(((a.float().cpu() - b.float().cpu()).abs() * mask).max())


def _assert_only_adapters_train(mega) -> None:
    """Megatron's DDP buffers and distributed optimizer hold the adapters and nothing else."""
    adapters = set(mega.lora.parameters())
    assert set(mega.model.params_with_grad) == adapters
    base = [p for p in mega.model.module.parameters() if p not in adapters]
    assert base and not any(p.requires_grad for p in base)
    held = sum(p.numel() for o in mega._optimizers() for g in o.optimizer.param_groups for p in g["params"])
    assert held == sum(p.numel() for p in adapters)
    moments = sum(v.numel() for o in mega._optimizers() for s in o.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    assert moments == 2 * held  # exp_avg, exp_avg_sq of the adapters only

def _assert_sync_and_first_step_as_torch(mega, native, batch, ours, theirs):
    """The adapters' sync payload is the torch trainer's (checksums too, in-process as well), and one
    RL step matches it: first-step ppo_kl 0, loss and grad norm. Returns (metrics, torch's metrics,
    |adapter moves| flattened: ours after the step against theirs)."""
    (sent, digest), (expected, expected_digest) = mega.get_weights(), native.get_weights()
    assert digest == expected_digest and list(sent) == list(expected)
    assert all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in sent)  # the adapters only
    assert all(sent[k].shape == expected[k].shape and torch.equal(sent[k].cpu(), expected[k]) for k in expected)
    assert mega.get_weights(in_process=True)[1] == native.get_weights(in_process=True)[1]
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert m["train/ppo_kl"] == 0.0
    assert m["train/loss"] == pytest.approx(n["train/loss"], rel=1e-4, abs=1e-6)
    assert m["train/grad_norm"] == pytest.approx(n["train/grad_norm"], rel=1e-4)
    # Adam's first step is ~lr * sign(grad): a near-zero gradient's sign may differ in fp32 (2 lr at most)
    return m, n, torch.cat([(ours[k].detach().cpu() - theirs[k].detach()).abs().flatten() for k in theirs])



@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen2_5_tiny", "qwen3_moe_tiny", "deepseek_v3_tiny"])
def test_adapters_logprobs_and_first_step_equal_the_torch_trainer(name, tmp_path, megatron_on_this_device):
    from miles.models import from_pretrained

    ckpt = _checkpoint(name, tmp_path)
    mega, native = _megatron(ckpt, megatron_on_this_device, TARGETS[name]), _torch(ckpt, TARGETS[name])
    ours, theirs = mega.lora.tensors(), native.lora.tensors()
    assert list(ours) == list(theirs)  # the same adapters, seeded the same
    assert all(torch.equal(ours[k].cpu(), theirs[k]) for k in theirs)
    if "moe" in name or "deepseek" in name:
        assert any(".experts." in k for k in ours)
    batch = _batch(mega.arch.vocab_size)
    mask = batch.loss_mask

    fresh = mega.logprobs(batch)
    mega.lora.enabled = False  # the hooks add nothing: the base GPTModel
    base = mega.logprobs(batch)
    mega.lora.enabled = True
    assert _masked_max(fresh, base, mask) == 0.0  # a fresh adapter (B = 0) is the base, exactly

    _randomize(mega.lora, native.lora)
    adapted, want = mega.logprobs(batch), native.logprobs(batch)
    worst, mean = _diff(adapted, want, mask)
    assert worst < TOL["fp32"] and mean < MEAN_TOL["fp32"], (worst, mean)
    assert _masked_max(adapted, base, mask) > 1e-2  # the adapters act

    m, n, moved = _assert_sync_and_first_step_as_torch(mega, native, batch, ours, theirs)
    print(f"\n{name}: log-probs max {worst:.3g} mean {mean:.3g}; adapters after the step max {float(moved.max()):.3g} "
          f"mean {float(moved.mean()):.3g}; loss {m['train/loss']:.6f} / {n['train/loss']:.6f}, grad norm "
          f"{m['train/grad_norm']:.6f} / {n['train/grad_norm']:.6f}")
    assert float(moved.max()) <= 2.5 * LR and float(moved.mean()) < 1e-6, (float(moved.max()), float(moved.mean()))
    assert any(float(b.detach().abs().sum()) > 0 for b in mega.lora.lora_B)

    reference = from_pretrained(ckpt, dtype=torch.float32).state_dict()
    state = mega._policy_state()
    assert set(state) == set(reference) and all(torch.equal(state[k].cpu(), reference[k]) for k in reference)
    _assert_only_adapters_train(mega)


@pytest.mark.parametrize("extra", [{"recompute": True}, {"adapters": ["only"]}], ids=["recompute", "named"])
def test_recompute_and_one_named_adapter_step_as_the_torch_trainer(extra, tmp_path, megatron_on_this_device):
    """trainer.recompute (Megatron's full recompute: a reentrant checkpoint per layer, whose frozen
    input would leave the adapters without gradient) and one named adapter (`<name>/` tensors and
    per-adapter metrics): the first step's metrics are the torch trainer's."""
    import dataclasses

    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    algo, cfg, precision = _cfgs(PROJ, **({} if "recompute" in extra else extra))
    cfg = dataclasses.replace(cfg, recompute=extra.get("recompute", False))
    mega = MegatronTrainer(ckpt, algo, cfg, precision, device=megatron_on_this_device, threads=1)
    native = TorchTrainer(ckpt, algo, cfg, precision, device="cpu", threads=1)
    _randomize(mega.lora, native.lora)
    batch = _batch(mega.arch.vocab_size)
    if "adapters" in extra:
        batch = dataclasses.replace(batch, adapter_ids=torch.zeros(len(batch), dtype=torch.long))
        assert all(k.startswith("only/") for k in mega.get_weights()[0])
    m, n = mega.train_rl(batch), native.train_rl(batch)
    assert set(m) == set(n)
    for key in ("train/loss", "train/grad_norm", *(["train/grad_norm/only"] if "adapters" in extra else [])):
        assert m[key] == pytest.approx(n[key], rel=1e-4, abs=1e-6), key
    assert m["train/grad_norm"] > 0


@pytest.mark.parametrize("name", ["qwen3_tiny", "qwen3_moe_tiny"])
def test_several_adapters_route_and_step_as_the_torch_trainer(name, tmp_path, megatron_on_this_device):
    """Two adapters over one base: each row through its own adapter (the torch trainer's log-probs;
    the other routing moves them), the first step the torch trainer's (each adapter clipped on its
    own: loss, grad norms, adapters), and a step with samples of `a` only leaves `b` and its Adam
    state as they were. qwen3_moe: expert adapters too, each expert's permuted tokens routed."""
    import dataclasses

    ckpt = _checkpoint(name, tmp_path)
    mega = _megatron(ckpt, megatron_on_this_device, TARGETS[name], adapters=["a", "b"])
    native = _torch(ckpt, TARGETS[name], adapters=["a", "b"])
    ours, theirs = mega.lora.tensors(), native.lora.tensors()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k].cpu(), theirs[k]) for k in theirs)
    _randomize(mega.lora, native.lora)
    plain = _batch(mega.arch.vocab_size)
    mixed = dataclasses.replace(plain, adapter_ids=torch.tensor([0, 1, 1, 0, 1, 0, 0, 1]))
    got = mega.logprobs(mixed)
    worst, mean = _diff(got, native.logprobs(mixed), plain.loss_mask)
    print(f"\n{name}, two adapters: log-probs max {worst:.3g} mean {mean:.3g}")
    assert worst < TOL["fp32"] and mean < MEAN_TOL["fp32"], (worst, mean)
    swapped = dataclasses.replace(plain, adapter_ids=1 - mixed.adapter_ids)
    assert _masked_max(mega.logprobs(swapped), got, plain.loss_mask) > 1e-2  # the route acts

    def assert_step_equal(batch):
        m, n = mega.train_rl(batch), native.train_rl(batch)
        assert set(m) == set(n)
        for key in [k for k in n if k.startswith(("train/loss", "train/grad_norm"))]:
            assert m[key] == pytest.approx(n[key], rel=1e-4, abs=1e-6), key
        moved = torch.cat([(ours[k].detach().cpu() - theirs[k].detach()).abs().flatten() for k in theirs])
        assert float(moved.max()) <= 2.5 * LR and float(moved.mean()) < 1e-6, (float(moved.max()), float(moved.mean()))
        return m

    assert_step_equal(mixed)
    b_params = {id(p) for p in mega.lora.adapter_parameters(1)}
    adam = {id(p): {k: v.clone() for k, v in s.items()} for o in mega._optimizers()
            for p, s in o.optimizer.state.items()}
    shards = {id(mp): id(sp) for o in mega._optimizers()
              for mg, sg in zip(o.model_fp32_groups, o.shard_fp32_groups) for mp, sp in zip(mg, sg)}
    before = {k: v.detach().clone() for k, v in ours.items() if k.startswith("b/")}
    m = assert_step_equal(dataclasses.replace(plain, adapter_ids=torch.zeros(len(plain), dtype=torch.long)))
    assert m["train/grad_norm/b"] == 0.0
    assert all(torch.equal(ours[k], v) for k, v in before.items())  # b: no sample, no step
    after = {id(p): s for o in mega._optimizers() for p, s in o.optimizer.state.items()}
    for model_param in b_params:
        shard = shards[model_param]
        assert all(torch.equal(after[shard][k], v) for k, v in adam[shard].items())  # no moment decay either
    mega.save(str(tmp_path / "final"))  # the frozen base, each adapter's PEFT directory beside it
    assert all((tmp_path / "final" / "adapter" / name / "adapter_model.safetensors").is_file() for name in "ab")


def test_a_rollout_only_quantized_recipe_syncs_the_adapters(tmp_path, megatron_on_this_device):
    """fp32_train_int4_rollout: the engine quantizes its own base; the trainer trains over the dense
    base and syncs the adapters only, as trainer=torch does (same names, same checksum)."""
    from miles.config.schema import PrecisionCfg, Quant
    from miles.trainer.megatron.trainer import MegatronTrainer
    from miles.trainer.torch_trainer import TorchTrainer

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    algo, cfg, _ = _cfgs(PROJ)
    precision = PrecisionCfg(name="fp32_train_int4_rollout", rollout_quant=Quant("int4"), int4_group_size=32)
    mega = MegatronTrainer(ckpt, algo, cfg, precision, device=megatron_on_this_device, threads=1)
    native = TorchTrainer(ckpt, algo, cfg, precision, device="cpu", threads=1)
    _randomize(mega.lora, native.lora)
    (got, digest), (want, want_digest) = mega.get_weights(), native.get_weights()
    assert digest == want_digest and list(got) == list(want) and all(k.endswith("lora_A.weight") or
                                                                      k.endswith("lora_B.weight") for k in got)


def test_bf16_base_resume_and_offload(tmp_path, megatron_on_this_device):
    """bf16: the base in bf16 with no optimizer state (no fp32 main copy), the adapters fp32 and
    synced in bf16 as trainer=torch's; a resumed trainer and an offloaded-and-onloaded one continue
    bit for bit."""
    from miles.trainer import offload

    ckpt = _checkpoint("qwen3_tiny", tmp_path)
    first = _megatron(ckpt, megatron_on_this_device, PROJ, "bf16")
    # the matrices in bf16 (the local spec's torch norms keep their weights in fp32, as without LoRA)
    assert all(p.dtype == torch.bfloat16 for n, p in first.model.module.named_parameters()
               if "miles_lora" not in n and p.dim() >= 2)
    assert all(p.dtype == torch.float32 for p in first.lora.parameters())
    batch = _batch(first.arch.vocab_size)
    before = {k: v.clone() for k, v in first._policy_state().items()}
    first.train_rl(batch)
    _assert_only_adapters_train(first)
    assert all(torch.equal(v, before[k]) for k, v in first._policy_state().items())
    weights, _ = first.get_weights()
    want, _ = _torch(ckpt, PROJ, "bf16").get_weights()
    assert list(weights) == list(want) and all(w.dtype == torch.bfloat16 for w in weights.values())

    first.save_state(str(tmp_path / "state"))
    assert (tmp_path / "state/adapter/adapter_config.json").is_file()
    expected = first.train_rl(batch)
    second = _megatron(ckpt, megatron_on_this_device, PROJ, "bf16")
    second.load_state(str(tmp_path / "state"))
    assert second.train_rl(batch) == expected
    assert all(torch.equal(a, b) for a, b in zip(first.lora.parameters(), second.lora.parameters()))

    sizes = second.offload_bytes()
    assert all(sizes[tag] > 0 for tag in ("params", "grads", "optimizer")), sizes
    offload.FORCE_COPY = True  # on the CPU too, the tensors move (fresh copies)
    try:
        second.offload()
        assert second.offload_bytes() == {"params": 0, "grads": 0, "optimizer": 0}
        second.onload()
    finally:
        offload.FORCE_COPY = False
    assert second.train_rl(batch) == first.train_rl(batch)


def test_export_loads_in_peft_with_the_trainers_logprobs(hf_dir, tmp_path, megatron_on_this_device):
    peft = pytest.importorskip("peft")
    import transformers

    ckpt, vocab = hf_dir, _LORA_TESTS.VOCAB
    mega = _megatron(str(ckpt), megatron_on_this_device, PROJ, rank=8)
    _randomize(mega.lora)
    batch = _batch(vocab)
    ours = mega.logprobs(batch).cpu()
    mega.save(str(tmp_path / "final"))
    assert (tmp_path / "final/adapter/adapter_model.safetensors").is_file()

    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
    model = peft.PeftModel.from_pretrained(hf.eval(), tmp_path / "final" / "adapter").eval()

    def logprobs(m):
        with torch.no_grad():
            logits = m(input_ids=batch.tokens).logits[:, :-1].float()
        return logits.log_softmax(-1).gather(-1, batch.tokens[:, 1:, None])[..., 0] * batch.loss_mask

    peft_diff = _masked_max(logprobs(model), ours, batch.loss_mask)
    print(f"\nPEFT on transformers vs the Megatron trainer: max |dlogp| {peft_diff:.3g}")
    assert peft_diff <= 1e-5
    with model.disable_adapter():  # the adapter matters
        assert _masked_max(logprobs(model), ours, batch.loss_mask) > 1e-3
    merged = _torch(str(tmp_path / "final"), PROJ)  # the merged export (its own fresh adapters: B = 0)
    assert _masked_max(merged.logprobs(batch), ours, batch.loss_mask) <= 1e-5


def test_what_is_not_built_is_refused(tmp_path, megatron_on_this_device, compose):
    from miles.trainer.megatron.rules import megatron_problems

    ckpt = _checkpoint("qwen3_moe_tiny", tmp_path)
    from miles.config.schema import FP8Scheme, PrecisionCfg, Quant
    from miles.trainer.megatron.trainer import MegatronTrainer

    algo, cfg, _ = _cfgs(PROJ)
    for scheme, why in [("w8a8", "w8a8's FP8 GEMMs in the forward need Transformer Engine")]:
        with pytest.raises(ValueError, match=why):
            MegatronTrainer(ckpt, algo, cfg, PrecisionCfg(name="fp8", train_quant=Quant("fp8"), rollout_quant=Quant("fp8"),
                                                          fp8_scheme=FP8Scheme(scheme)),
                            device=megatron_on_this_device, threads=1)
    gpu = ["trainer=megatron", "hardware=h200", "hardware.gpus_per_node=1", "dry_run=true", "trainer.lora.rank=8"]
    assert megatron_problems(compose(gpu)) == []
    two = ["task.kind=file", "task.train_file=p.jsonl", "trainer.lora.adapters=[a,b]", "trainer.lora.adapter_key=k"]
    assert megatron_problems(compose([*gpu, *two])) == []
    assert megatron_problems(compose([*gpu, "model=qwen3_moe_tiny", "trainer.lora.target_modules=[q_proj,experts]"])) == []
    assert megatron_problems(compose([*gpu, *two, "model=qwen3_moe_tiny",
                                      "trainer.lora.target_modules=[q_proj,experts]"])) == []
    assert megatron_problems(compose([*gpu, "precision=int4_qat"])) == []  # QLoRA
    assert megatron_problems(compose([*gpu, "precision=fp8"])) == []  # w8a16: QLoRA over the FP8 round trip
    problems = megatron_problems(compose([*gpu, "precision=fp8", "precision.fp8_scheme=w8a8"]))
    assert problems == ["trainer=megatron does not support precision=fp8 (w8a8's FP8 GEMMs need Transformer "
                        "Engine) yet: use trainer=torch"], problems
