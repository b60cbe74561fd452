"""Images through the native engine and the trainer (tiny Qwen2.5-VL, fp32, CPU):

- the engine's sampled log-probs equal transformers' Qwen2_5_VLForConditionalGeneration on the
  same checkpoint, prompt + response with the images (its own mRoPE and image features), and the
  trainer's recomputed ones (`mismatch/logprob_abs_diff` ~1e-7); the first step's ppo_kl is 0;
- the vision tower runs once per generate call, over each distinct prompt's images once (not n times);
- padded, packed and prompt-sharing micro-batches give the same log-probs: each sample keeps its images;
- a response that samples the image token is text (no image fills it), on both sides.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, RolloutCfg, TrainerCfg
from miles.data import shape_count
from miles.data.prompt_format import PromptFormat
from miles.data.tokenizer import TokenizerInfo
from miles.data.vision_inputs import VisionInputs
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch
from vlm_rollout_checks import FP32, assert_trainer_recomputes_the_engine, layout_logprobs

CONF = "conf/model/qwen2_5_vl_tiny.yaml"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(root / CONF)))
    examples = shape_count.examples(0, "train", 6) + shape_count.examples(0, "eval", 2, train_size=6)
    alphabet = "".join(sorted({c for e in examples for c in e.prompt + e.label}))
    return random_checkpoint(model, alphabet, 0, tmp_path_factory.mktemp("vlm") / "init", chat=True), examples


def _prompts(directory, examples):
    tok = TokenizerInfo.load(directory)
    fmt = PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(directory, tok))
    encoded = [fmt.encode(e) for e in examples]
    return [fmt(e) for e in examples], [ids for ids, _ in encoded], [images for _, images in encoded]


def _rollout(directory, examples, n=4, max_new=6, seed=0):
    texts, ids, images = _prompts(directory, examples)
    engine = NativeEngine(str(directory), RolloutCfg(max_new_tokens=max_new, temperature=1.0), DType.fp32, seed=seed)
    samples = engine.generate(texts, [e.label for e in examples], n=n, prompt_ids=ids, images=images)
    for s in samples:
        s.images = images[s.group]
    return engine, samples


def test_engine_logprobs_equal_transformers_and_the_trainer(checkpoint):
    import transformers

    directory, examples = checkpoint
    engine, samples = _rollout(directory, examples[:3], n=4)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(str(directory), dtype=torch.float32).eval()
    image_id = engine.model.config.vision.image_token_id
    checked = 0
    for s in samples:
        if image_id in s.response_ids:  # transformers would take it for an image placeholder
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            logits = hf(input_ids=ids, pixel_values=s.images["pixel_values"], image_grid_thw=s.images["image_grid_thw"],
                        mm_token_type_ids=(ids == image_id).int()).logits[0]
        p = len(s.prompt_ids)
        ref = torch.log_softmax(logits[p - 1:-1].float(), -1).gather(-1, ids[0, p:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=2e-6, rtol=0), (s.rollout_logprobs, ref)
        checked += 1
    assert checked >= 8

    assert_trainer_recomputes_the_engine(str(directory), samples, engine.pad_id)


def test_vision_tower_runs_once_per_prompt(checkpoint):
    directory, examples = checkpoint
    texts, ids, images = _prompts(directory, examples[:3])
    engine = NativeEngine(str(directory), RolloutCfg(max_new_tokens=4), DType.fp32)
    calls = []
    engine.model.visual.register_forward_hook(lambda module, args, out: calls.append(args[1].shape[0]))
    samples = engine.generate(texts, ["0"] * 3, n=8, prompt_ids=ids, images=images)
    assert len(samples) == 24
    assert calls == [3]  # one tower call, each prompt's image once (not once per sample)


def test_packing_keeps_each_samples_images(checkpoint):
    """Eight prompts of equal token ids (one 3 x 3 grid each) but different images: padded, packed
    and prompt-sharing layouts give the same log-probs, so no sample saw another's image."""
    directory, examples = checkpoint
    _, samples = _rollout(directory, examples, n=2, seed=1)
    batch = build_train_batch(samples, torch.zeros(len(samples)), 0)
    out, trainer = layout_logprobs(directory, batch, padded_rows=5, max_tokens=300)
    assert torch.allclose(out["padded"], out["packed"], atol=1e-5, rtol=0)
    assert torch.allclose(out["padded"], out["shared"], atol=1e-5, rtol=0)
    rollout = batch.rollout_logprobs
    assert (out["padded"] - rollout).abs().max() < 1e-5
    # Swapping two samples' images changes their log-probs: the images do reach the forward.
    swapped = replace(batch, images=[batch.images[2], batch.images[3], batch.images[0], batch.images[1],
                                     *batch.images[4:]])
    assert not torch.allclose(trainer.logprobs(swapped)[:4], out["shared"][:4], atol=1e-4)


def test_a_sampled_image_token_is_text(checkpoint):
    """Responses that sample the image token (a random model does): the engine decodes it as text,
    and the trainer, whose placeholders are the prompts' only, recomputes the same log-probs."""
    directory, examples = checkpoint
    engine, samples = _rollout(directory, examples[:4], n=16, max_new=8, seed=3)
    image_id = engine.model.config.vision.image_token_id
    with_token = [s for s in samples if image_id in s.response_ids]
    assert with_token, "no response sampled the image token: pick another seed"
    trainer = TorchTrainer(str(directory), AlgoCfg(name=AlgoName.grpo), TrainerCfg(), FP32, temperature=1.0)
    batch = build_train_batch(with_token, torch.zeros(len(with_token)), engine.pad_id)
    assert (trainer.logprobs(batch) - batch.rollout_logprobs).abs().max() < 1e-5


def test_an_engine_fleet_sends_each_prompt_its_images(checkpoint):
    """rollout.num_engines > 1 with images: each prompt's vision inputs travel in its chunk, so two
    in-process engines give, with per-group seeds, the samples one engine gives for the whole batch."""
    from miles.orchestrate.handles import LocalHandle
    from miles.rollout.router import EngineFleet

    directory, examples = checkpoint
    texts, ids, images = _prompts(directory, examples[:4])
    labels, seeds = [e.label for e in examples[:4]], [11, 12, 13, 14]
    cfg = RolloutCfg(max_new_tokens=5, temperature=1.0)
    fleet = EngineFleet([LocalHandle(NativeEngine(str(directory), cfg, DType.fp32)) for _ in range(2)], chunk_groups=1)
    got = fleet.generate(texts, labels, n=2, prompt_ids=ids, seeds=seeds, images=images)
    want = NativeEngine(str(directory), cfg, DType.fp32).generate(texts, labels, n=2, prompt_ids=ids, seeds=seeds,
                                                                   images=images)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert torch.allclose(torch.tensor([lp for s in got for lp in s.rollout_logprobs]),
                          torch.tensor([lp for s in want for lp in s.rollout_logprobs]), atol=1e-5)
    swapped = fleet.generate(texts, labels, n=2, prompt_ids=ids, seeds=seeds, images=images[::-1])
    assert [s.rollout_logprobs for s in swapped] != [s.rollout_logprobs for s in got]  # the images matter


def test_critic_values_see_each_samples_images(checkpoint):
    """PPO's critic on a VLM (algo.advantage=gae): its value model forwards each sample with the
    sample's images, so padded and packed micro-batches give the same values, and moving the images
    to other samples moves them. Its vision tower follows trainer.freeze_vision, as the policy's."""
    from miles.config.schema import CriticCfg
    from miles.trainer.critic import TorchCritic

    directory, examples = checkpoint
    engine, samples = _rollout(directory, examples[:3], n=2)
    batch = build_train_batch(samples, torch.zeros(len(samples)), engine.pad_id)

    def values(trainer_cfg, batch):
        critic = TorchCritic(str(directory), CriticCfg(), trainer_cfg, FP32)
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.model.value_head.weight, std=0.1)  # values that depend on the hidden states
        return critic.values(batch), critic

    padded, critic = values(TrainerCfg(pack_sequences=False, micro_batch_size=len(samples)), batch)
    packed, _ = values(TrainerCfg(share_prompts=False, max_tokens_per_micro_batch=256), batch)
    assert torch.allclose(padded, packed, atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in critic.model.body.visual.parameters())  # trainer.freeze_vision
    swapped = replace(batch, images=batch.images[2:] + batch.images[:2])  # each prompt's images to another prompt
    moved, _ = values(TrainerCfg(pack_sequences=False, micro_batch_size=len(samples)), swapped)
    assert float((moved - padded).abs().max()) > 1e-4

