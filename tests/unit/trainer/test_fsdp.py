"""FSDP2 trainer (miles.trainer.fsdp, fsdp_group): 2 gloo ranks in Ray actors compute the update of
the 1-rank native TorchTrainer on the same global batch, resume exactly from their sharded
checkpoint, and sync the same weights."""

import time
from dataclasses import replace
from pathlib import Path

import pytest
import ray
import torch
from omegaconf import OmegaConf

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, PrecisionCfg, Quant, RolloutCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained
from miles.orchestrate.checkpoints import random_checkpoint
from miles.transport.checksum import checksum
from miles.rollout.native import NativeEngine
from miles.trainer.fsdp import token_balanced_bounds
from miles.trainer.fsdp_group import FSDPGroup
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch

pytestmark = pytest.mark.slow

CONF = Path(__file__).resolve().parents[3] / "conf"
PROMPTS = ["1+2=", "35+47=", "9*9=", "(12-3)*4="]
FP32 = PrecisionCfg(name="fp32")
# Small micro-batches: each rank accumulates over several, and the ranks get different counts.
# grad_clip below the gradient norms of these steps: the clip over the sharded gradients is in the update.
CFG = TrainerCfg(lr=1e-2, global_batch_size=8, micro_batch_size=2, max_tokens_per_micro_batch=24, grad_clip=0.5)
STEPS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                              OmegaConf.load(CONF / "model" / "qwen3_tiny.yaml")))
    return str(random_checkpoint(cfg, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("qwen3_tiny")))


@pytest.fixture(scope="module")
def batch(ckpt):
    """8 engine samples (4 prompts x 2, up to 8 response tokens), advantages spread over [-1, 1]."""
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), seed=0)
    samples = engine.generate(PROMPTS, ["3", "82", "81", "36"], n=2)
    return build_train_batch(samples, torch.linspace(-1, 1, len(samples)), engine.pad_id)


@pytest.fixture(scope="module")
def local_ray(ray_connection):
    """The module's local Ray (tests/conftest.py `ray_connection`)."""
    yield


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def native_run(ckpt, batch, algo, optimizer, calls):
    """calls: (method, batch) pairs. -> their metrics, then get_weights() and logprobs(batch)."""
    trainer = TorchTrainer(ckpt, algo, CFG, FP32, threads=1, max_response_len=8, optimizer=optimizer)
    metrics = [getattr(trainer, method)(b) for method, b in calls]
    return metrics, trainer.get_weights(), trainer.logprobs(batch)


def group_run(ckpt, batch, algo, optimizer, calls, cfg=CFG):
    group = FSDPGroup(2, ckpt, algo, cfg, FP32, threads=1, max_response_len=8, optimizer=optimizer)
    try:
        metrics = [group.call(method, b) for method, b in calls]
        return metrics, group.call("get_weights"), group.call("logprobs", batch)
    finally:
        group.shutdown()


def assert_same_metrics(group: list[dict], native: list[dict], tol: float):
    for g, n in zip(group, native, strict=True):
        assert g.keys() == n.keys()
        for k in n:
            assert abs(g[k] - n[k]) <= tol * max(1.0, abs(n[k])), (k, g[k], n[k])


def test_token_balanced_bounds():
    mask = torch.zeros(5, 10)
    for i, last in enumerate([9, 1, 1, 1, 5]):  # tokens up to the last loss target: 10, 2, 2, 2, 6
        mask[i, last] = 1
    assert token_balanced_bounds(mask, 2) == [0, 1, 5]
    assert token_balanced_bounds(mask, 3) == [0, 1, 3, 5]
    assert token_balanced_bounds(mask[:1], 2) == [0, 0, 1]  # fewer samples than ranks: one idles


@pytest.fixture(scope="module")
def adamw_runs(ckpt, batch, local_ray):
    """3 PPO steps with the KL to a (sharded) reference in the loss, by 2 ranks and by 1."""
    algo = AlgoCfg(name=AlgoName.grpo, kl_coef=0.1)
    calls = [("train_rl", batch)] * STEPS + [("kl_to_ref", batch)]
    return group_run(ckpt, batch, algo, "adamw", calls), native_run(ckpt, batch, algo, "adamw", calls)


def test_two_ranks_adamw_equal_one_rank(adamw_runs):
    (g_calls, (g_weights, _), g_logp), (n_calls, (n_weights, _), n_logp) = adamw_runs
    (*g_metrics, g_kl), (*n_metrics, n_kl) = g_calls, n_calls
    assert all(m["train/grad_norm"] > CFG.grad_clip for m in n_metrics)  # every step clipped
    assert n_metrics[-1]["train/kl_ref"] > 0.0  # the policy has moved away from the reference
    assert_same_metrics(g_metrics, n_metrics, 1e-4)
    assert max_diff(g_weights, n_weights) <= 1e-4
    assert float((g_logp - n_logp).abs().max()) <= 1e-4
    assert float(n_kl.abs().max()) > 0.0 and float((g_kl - n_kl).abs().max()) <= 1e-4


def test_two_ranks_sgd_equal_one_rank(ckpt, batch, local_ray):
    """SGD, two optimizer steps per rollout with TIS (the old log-probs of every rank's rows feed the
    weights); then steps of one sample, where one rank only idles; then an SFT step. SGD's update is
    linear in the gradient, so the match is tight."""
    algo = AlgoCfg(name=AlgoName.grpo, num_steps_per_rollout=2, tis="token", tis_clip=1.001)
    calls = [("train_rl", batch)] * STEPS + [("train_rl", batch.slice(0, 2)), ("train_sft", batch)]
    (g_metrics, (g_weights, _), g_logp) = group_run(ckpt, batch, algo, "sgd", calls)
    (n_metrics, (n_weights, _), n_logp) = native_run(ckpt, batch, algo, "sgd", calls)
    assert n_metrics[STEPS - 1]["mismatch/tis_clipfrac"] > 0.0  # the weights are not all 1
    assert_same_metrics(g_metrics, n_metrics, 1e-6)
    assert max_diff(g_weights, n_weights) <= 1e-6
    assert float((g_logp - n_logp).abs().max()) <= 1e-6


def test_recomputing_ranks_equal_one_rank(ckpt, batch, local_ray):
    """trainer.recompute=true on the ranks: each sharded layer recomputes in backward, after FSDP has
    gathered its parameters again; the steps are the one-rank trainer's (stored activations)."""
    algo = AlgoCfg(name=AlgoName.grpo)
    calls = [("train_rl", batch)] * 2
    (g_metrics, (g_weights, _), _) = group_run(ckpt, batch, algo, "sgd", calls, cfg=replace(CFG, recompute=True))
    (n_metrics, (n_weights, _), _) = native_run(ckpt, batch, algo, "sgd", calls)
    assert_same_metrics(g_metrics, n_metrics, 1e-6)
    assert max_diff(g_weights, n_weights) <= 1e-6


def test_group_weights_are_the_one_rank_weights(adamw_runs):
    (_, (g_weights, g_digest), _), (_, (n_weights, _), _) = adamw_runs
    assert list(g_weights) == list(n_weights)
    assert all(g_weights[k].dtype == n_weights[k].dtype and g_weights[k].shape == n_weights[k].shape
               for k in n_weights)
    assert g_digest == checksum(g_weights)


def test_resume_from_sharded_checkpoint_is_exact(ckpt, batch, local_ray, tmp_path):
    algo = AlgoCfg(name=AlgoName.grpo)
    group = FSDPGroup(2, ckpt, algo, CFG, FP32, threads=1, max_response_len=8)
    try:
        group.call("train_rl", batch)
        group.call("save_state", str(tmp_path / "state"))
        straight = [group.call("train_rl", batch) for _ in range(STEPS - 1)]
        straight_weights, _ = group.call("get_weights")
    finally:
        group.shutdown()
    group = FSDPGroup(2, ckpt, algo, CFG, FP32, threads=1, max_response_len=8)
    try:
        group.call("load_state", str(tmp_path / "state"))
        resumed = [group.call("train_rl", batch) for _ in range(STEPS - 1)]
        resumed_weights, _ = group.call("get_weights")
        group.call("save", str(tmp_path / "hf"))
    finally:
        group.shutdown()
    assert resumed == straight
    assert max_diff(resumed_weights, straight_weights) == 0.0
    assert max_diff(from_pretrained(tmp_path / "hf").state_dict(), resumed_weights) == 0.0


def test_bf16_group_trains_like_autocast(ckpt, batch, local_ray):
    """bf16: the ranks gather bf16 parameters (MixedPrecisionPolicy) where the native trainer
    autocasts over fp32 ones, so the numbers differ by bf16 rounding, not more."""
    bf16 = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
    algo = AlgoCfg(name=AlgoName.grpo)
    group = FSDPGroup(2, ckpt, algo, CFG, bf16, threads=1, max_response_len=8, optimizer="sgd")
    try:
        g_metrics = group.call("train_rl", batch)
        g_weights, g_digest = group.call("get_weights")
    finally:
        group.shutdown()
    native = TorchTrainer(ckpt, algo, CFG, bf16, threads=1, max_response_len=8, optimizer="sgd")
    n_metrics = native.train_rl(batch)
    n_weights, _ = native.get_weights()
    assert all(w.dtype == torch.bfloat16 for w in g_weights.values()) and g_digest == checksum(g_weights)
    assert_same_metrics([g_metrics], [n_metrics], 1e-2)
    assert max_diff(g_weights, n_weights) <= 1e-2  # a bf16 step at 1.0 is 7.8e-3


def test_a_rank_that_cannot_start_fails_the_group_and_frees_its_cpus(ckpt, local_ray):
    fp8 = PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8)
    with pytest.raises(ValueError, match="does not fake-quantize"):
        FSDPGroup(2, ckpt, AlgoCfg(name=AlgoName.grpo), CFG, fp8, threads=1)
    deadline = time.monotonic() + 30  # Ray frees a killed actor's resources asynchronously
    cpus = ray.cluster_resources()["CPU"]
    while ray.available_resources().get("CPU", 0) < cpus and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == cpus


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(checkpoint, batch): a tiny Qwen2.5-VL and engine samples of shape_count prompts with their images."""
    from miles.data import shape_count
    from miles.data.prompt_format import PromptFormat
    from miles.data.tokenizer import TokenizerInfo
    from miles.data.vision_inputs import VisionInputs

    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                OmegaConf.load(CONF / "model" / "qwen2_5_vl_tiny.yaml")))
    examples = shape_count.examples(0, "train", 4)
    alphabet = "".join(sorted({c for e in examples for c in e.prompt + e.label}))
    ckpt = str(random_checkpoint(model, alphabet, 0, tmp_path_factory.mktemp("vlm"), chat=True))
    tok = TokenizerInfo.load(ckpt)
    fmt = PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(ckpt, tok))
    encoded = [fmt.encode(e) for e in examples]
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=6), seed=0)
    samples = engine.generate([fmt(e) for e in examples], [e.label for e in examples], n=2,
                              prompt_ids=[ids for ids, _ in encoded], images=[images for _, images in encoded])
    for s in samples:
        s.images = encoded[s.group][1]
    return ckpt, build_train_batch(samples, torch.linspace(-1, 1, len(samples)), engine.pad_id)


def vlm_ranks_and_one_process(ckpt, vlm_batch, cfg, saved: Path):
    """2 SGD steps on the VLM batch by 2 ranks (their gathered policy saved to `saved`) and by the
    1-process trainer, checked equal in their metrics; -> (the ranks' weights, the 1-process trainer)."""
    algo = AlgoCfg(name=AlgoName.grpo)
    group = FSDPGroup(2, ckpt, algo, cfg, FP32, threads=1, max_response_len=8, optimizer="sgd")
    try:
        g_metrics = [group.call("train_rl", vlm_batch) for _ in range(2)]
        g_weights, _ = group.call("get_weights")
        group.call("save", str(saved))
    finally:
        group.shutdown()
    native = TorchTrainer(ckpt, algo, cfg, FP32, threads=1, max_response_len=8, optimizer="sgd")
    assert_same_metrics(g_metrics, [native.train_rl(vlm_batch) for _ in range(2)], 1e-6)
    return g_weights, native


def test_two_ranks_train_a_vision_language_model_as_one_process(vlm, tmp_path, local_ray):
    """A tiny Qwen2.5-VL (tower trained too, trainer.freeze_vision=false) on engine samples with
    images: each rank's micro-batches carry their samples' images, and 2 ranks' SGD steps are the
    1-process trainer's; the gathered policy saves as a vision-language checkpoint."""
    ckpt, vlm_batch = vlm
    g_weights, native = vlm_ranks_and_one_process(ckpt, vlm_batch, replace(CFG, freeze_vision=False), tmp_path / "saved")
    n_weights, _ = native.get_weights()
    assert any(k.startswith("visual.") for k in n_weights) and max_diff(g_weights, n_weights) <= 1e-6
    assert float((n_weights["visual.patch_embed.proj.weight"] - from_pretrained(ckpt).state_dict()[
        "visual.patch_embed.proj.weight"]).abs().max()) > 0  # the tower trained
    assert type(from_pretrained(str(tmp_path / "saved"))).__name__ == "VisionLM"


def test_two_ranks_train_a_vision_language_models_adapters_as_one_process(vlm, tmp_path, local_ray):
    """LoRA on the VLM (the decoder's projections; the tower frozen as the base): 2 ranks' SGD steps
    on the samples with their images give the 1-process trainer's adapters, only the adapters travel,
    and the gathered export is the adapted vision-language model."""
    from miles.config.schema import LoRACfg

    ckpt, vlm_batch = vlm
    g_weights, native = vlm_ranks_and_one_process(ckpt, vlm_batch, replace(CFG, lora=LoRACfg(rank=4, alpha=8.0)),
                                                  tmp_path / "saved")
    n_weights, _ = native.get_weights()
    assert set(g_weights) == set(n_weights) == set(native.lora.tensors())  # the adapters only
    assert not any(k.startswith("visual.") for k in n_weights)
    assert any(float(w.abs().max()) > 0 for k, w in n_weights.items() if "lora_B" in k)  # B moved off zero
    assert max_diff(g_weights, n_weights) <= 1e-6
    merged = TorchTrainer(str(tmp_path / "saved"), AlgoCfg(name=AlgoName.grpo), replace(CFG, lora=LoRACfg()), FP32,
                          threads=1, max_response_len=8)
    assert type(merged.model).__name__ == "VisionLM"
    torch.testing.assert_close(merged.logprobs(vlm_batch), native.logprobs(vlm_batch), atol=1e-5, rtol=0)
