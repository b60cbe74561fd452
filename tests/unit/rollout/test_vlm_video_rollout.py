"""Videos through the native engine and the trainer (tiny random Qwen2.5-VL and Qwen3-VL, fp32,
CPU), prompts read from records whose frames are drawn with PIL (miles/data/videos.py):

- the engine's sampled log-probs equal transformers' on prompt + response with the videos (and an
  image beside one of them), and the trainer recomputes them (`mismatch/logprob_abs_diff` < 1e-6,
  first-step ppo_kl 0);
- the vision tower runs once per generate call, over each distinct prompt's images and videos once;
- padded, packed and prompt-sharing micro-batches give the same log-probs (each sample keeps its
  videos), and swapping two samples' videos changes theirs;
- a response that samples the video token is text, on both sides.

Waiting on the engine and trainer: miles/rollout/native.py (`_vision_inputs` passes only
pixel_values / image_grid_thw; its prefill's mrope_positions no video grids) and
miles/trainer/packing.py (micro-batches carry image inputs and image placeholders only) are not yet
wired for the video keys; docs/vlm.md ("Videos") lists the change. Every test here passed with it
applied (2026-12-04); strict, so that they fail once it lands and the marker must go.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from PIL import Image, ImageDraw

from miles.config.schema import AlgoCfg, AlgoName, DType, ModelCfg, RolloutCfg, TrainerCfg
from miles.data.images import load_image_file, to_example
from miles.data.prompt_format import PromptFormat
from miles.data.tokenizer import TokenizerInfo
from miles.data.vision_inputs import VisionInputs
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch
from vlm_rollout_checks import FP32, assert_trainer_recomputes_the_engine, layout_logprobs

ROOT = Path(__file__).resolve().parents[3]
FAMILIES = {"qwen2_5_vl_tiny": transformers.Qwen2_5_VLForConditionalGeneration,
            "qwen3_vl_tiny": transformers.Qwen3VLForConditionalGeneration}


def _clip(directory: Path, frames: int, side: int, seed: int) -> None:
    """A square moving across `frames` frames."""
    directory.mkdir(parents=True)
    for k in range(frames):
        image = Image.new("RGB", (side, side), (123, 117, 104))
        x = (seed * 7 + k * 9) % (side - 12)
        ImageDraw.Draw(image).rectangle([x, 10, x + 11, 21], fill=(200, 30 * seed % 256, 40))
        image.save(directory / f"{k:03d}.png")


def _records(root: Path) -> list:
    """Four prompts: videos of 4 and 3 frames (different sides and rates), an image with a video,
    and a video whose frames equal the first's but at another rate (same tokens but its times)."""
    _clip(root / "a", 4, 56, 1)
    _clip(root / "b", 3, 84, 2)
    _clip(root / "c", 4, 56, 3)
    Image.new("RGB", (56, 56), (0, 160, 0)).save(root / "still.png")
    ask = {"type": "text", "text": "Where does it go?"}
    rows = [[{"type": "video", "video": "a", "fps": 2}, ask],
            [{"type": "video", "video": "b", "fps": 3}, ask],
            [{"type": "image", "image": "still.png"}, {"type": "video", "video": "c", "fps": 2}, ask],
            [{"type": "video", "video": "a", "fps": 4}, ask]]
    path = root / "videos.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": parts}], "label": "1"}) + "\n"
                            for parts in rows))
    return [to_example(e) for e in load_image_file(path)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
    """(family conf, checkpoint, examples, prompt texts, prompt ids, vision inputs per prompt)."""
    root = tmp_path_factory.mktemp(request.param)
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                OmegaConf.load(ROOT / "conf" / "model" / f"{request.param}.yaml")))
    examples = _records(root)
    directory = random_checkpoint(model, "0123456789", 0, root / "init", chat=True)
    tok = TokenizerInfo.load(directory)
    fmt = PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(directory, tok))
    encoded = [fmt.encode(e) for e in examples]
    return request.param, directory, examples, [fmt(e) for e in examples], [i for i, _ in encoded], \
        [v for _, v in encoded]


def _rollout(setup, n=4, max_new=6, seed=0, prompts=slice(None)):
    _, directory, examples, texts, ids, inputs = setup
    engine = NativeEngine(str(directory), RolloutCfg(max_new_tokens=max_new, temperature=1.0), DType.fp32, seed=seed)
    samples = engine.generate(texts[prompts], [e.label for e in examples[prompts]], n=n, prompt_ids=ids[prompts],
                              images=inputs[prompts])
    for s in samples:
        s.images = inputs[prompts][s.group]
    return engine, samples


def test_engine_logprobs_equal_transformers_and_the_trainer(setup):
    conf = setup[0]
    engine, samples = _rollout(setup, n=4, prompts=slice(0, 3))
    hf = FAMILIES[conf].from_pretrained(str(setup[1]), dtype=torch.float32).eval()
    vision = engine.model.config.vision
    checked = 0
    for s in samples:
        if {vision.image_token_id, vision.video_token_id} & set(s.response_ids):  # transformers: a placeholder
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        types = (ids == vision.image_token_id).int() + 2 * (ids == vision.video_token_id).int()
        with torch.no_grad():
            logits = hf(input_ids=ids, mm_token_type_ids=types, **s.images).logits[0]
        p = len(s.prompt_ids)
        ref = torch.log_softmax(logits[p - 1:-1].float(), -1).gather(-1, ids[0, p:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=2e-6, rtol=0), (s.rollout_logprobs, ref)
        checked += 1
    assert checked >= 6

    assert_trainer_recomputes_the_engine(str(setup[1]), samples, engine.pad_id)


def test_vision_tower_runs_once_per_prompt(setup):
    _, directory, examples, texts, ids, inputs = setup
    engine = NativeEngine(str(directory), RolloutCfg(max_new_tokens=4), DType.fp32)
    calls = []
    engine.model.visual.register_forward_hook(lambda module, args, out: calls.append(args[1].shape[0]))
    samples = engine.generate(texts, ["1"] * 4, n=8, prompt_ids=ids, images=inputs)
    assert len(samples) == 32
    assert calls == [5]  # one tower call: 4 videos and 1 image, each once (not once per sample)


def test_packing_keeps_each_samples_videos(setup):
    """Padded, packed and prompt-sharing layouts give the same log-probs, so no sample saw
    another's video; prompts 0 and 3 hold the same frames at other rates."""
    directory = setup[1]
    _, samples = _rollout(setup, n=2, seed=1)
    batch = build_train_batch(samples, torch.zeros(len(samples)), 0)
    out, trainer = layout_logprobs(directory, batch, padded_rows=3, max_tokens=400)
    assert torch.allclose(out["padded"], out["packed"], atol=1e-5, rtol=0)
    assert torch.allclose(out["padded"], out["shared"], atol=1e-5, rtol=0)
    assert (out["padded"] - batch.rollout_logprobs).abs().max() < 1e-5
    # Prompts 0 and 2 hold videos of one size (4 frames of 56 px): swapped, their log-probs change.
    swapped = replace(batch, images=[batch.images[4], batch.images[5], *batch.images[2:4],
                                     batch.images[0], batch.images[1], *batch.images[6:]])
    assert not torch.allclose(trainer.logprobs(swapped)[:2], out["shared"][:2], atol=1e-4)


def test_a_sampled_video_token_is_text(setup):
    """Responses that sample the video token (a random model does): the engine decodes it as text,
    and the trainer, whose placeholders are the prompts' only, recomputes the same log-probs."""
    engine, samples = _rollout(setup, n=16, max_new=8, seed=3)
    with_token = [s for s in samples if engine.model.config.vision.video_token_id in s.response_ids]
    assert with_token, "no response sampled the video token: pick another seed"
    trainer = TorchTrainer(str(setup[1]), AlgoCfg(name=AlgoName.grpo), TrainerCfg(), FP32, temperature=1.0)
    batch = build_train_batch(with_token, torch.zeros(len(with_token)), engine.pad_id)
    assert (trainer.logprobs(batch) - batch.rollout_logprobs).abs().max() < 1e-5
