"""Checks every vision-language family passes against transformers, shared by the per-family test
modules (test_qwen3_vl.py, test_glm4v_moe.py; Qwen2.5-VL's predate them, test_qwen2_5_vl.py).

A tiny random transformers model (every parameter randomized, norms and biases included) saved by
transformers loads through our `from_pretrained` and gives the same float32 logits on a
left-padded batch whose rows hold images of three sizes (one larger than the learned position
grid, one equal, one smaller and not square); text-only prompts too; transformers loads what we
save with nothing missing or unexpected and the same logits; save -> load is bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from miles.models import from_hf_config, from_pretrained, save_pretrained
from miles.models.vlm import VisionLM
from zoo_checks import randomize

IMAGE, VIDEO, START, END = 100, 101, 102, 103
RTOL = 1e-4  # max |ours - theirs| / max |theirs| over real tokens (observed ~1e-6)
GRIDS = torch.tensor([[1, 8, 12], [1, 4, 4], [1, 6, 2]])  # (t, h, w) patches of the batch's three images


def tiny_hf_model(model_class, hf_config, seed: int = 0):
    """A random transformers model with eager attention (the reference math); every parameter
    randomized, and MoE router correction biases (buffers in transformers) too."""
    torch.manual_seed(seed)
    hf_config._attn_implementation = "eager"
    model = model_class(hf_config).eval()
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # of the size of the score gaps: it steers routing
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3)
    return model


def image_batch(patch_size: int, temporal_patch_size: int = 2):
    """(ids, attention mask, pixel_values, grids): row 0 one 8 x 12-patch image, row 1 a 4 x 4 and a
    6 x 2 image, left-padded; a 2 x 2 merge gives 24, 4 and 3 placeholders."""
    gen = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(GRIDS.prod(-1).sum()), 3 * temporal_patch_size * patch_size ** 2, generator=gen)
    span = lambda n: [START] + [IMAGE] * n + [END]  # noqa: E731
    rows = [[5, 6] + span(24) + [7, 8, 9], [10] + span(4) + [11, 12] + span(3) + [13]]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask, pixels, GRIDS


def rel_err(ours: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    keep = mask.bool()
    return ((ours - ref)[keep].abs().max() / ref[keep].abs().max()).item()


@torch.no_grad()
def hf_logits(hf, ids, mask, pixels, grids, image_id: int = IMAGE) -> torch.Tensor:
    return hf(input_ids=ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids,
              mm_token_type_ids=(ids == image_id).int()).logits


@torch.no_grad()
def check_loads_transformers_checkpoint(hf, tmp_path: Path, patch_size: int) -> VisionLM:
    """transformers save -> our from_pretrained: same logits with images and on text alone."""
    hf.save_pretrained(tmp_path / "hf")
    ours = from_pretrained(tmp_path / "hf").eval()
    assert isinstance(ours, VisionLM)
    ids, mask, pixels, grids = image_batch(patch_size)
    got = ours(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids)
    err = rel_err(got, hf_logits(hf, ids, mask, pixels, grids), mask)
    assert err < RTOL, f"logits with images differ from transformers by {err:.3g} (relative)"
    text = torch.randint(0, IMAGE, (2, 7), generator=torch.Generator().manual_seed(2))
    err = rel_err(ours(text), hf(input_ids=text).logits, torch.ones_like(text))
    assert err < RTOL, f"text-only logits differ from transformers by {err:.3g} (relative)"
    return ours


@torch.no_grad()
def check_transformers_loads_ours(model_class, hf_config, tmp_path: Path, patch_size: int, seed: int = 3) -> None:
    """our save_pretrained of a random model -> transformers: nothing missing or unexpected, the
    same logits with images; and our save -> load is bitwise with an equal config."""
    cfg = from_hf_config(hf_config.to_dict())
    ours = VisionLM(cfg, seed=seed).eval()
    randomize(ours, seed)
    save_pretrained(ours, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["model_type"] == cfg.family
    hf, info = model_class.from_pretrained(tmp_path / "ours", output_loading_info=True)
    # transformers would silently initialize anything it did not find at random.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.config._attn_implementation = "eager"
    ids, mask, pixels, grids = image_batch(patch_size)
    got = ours(ids, attention_mask=mask, pixel_values=pixels, image_grid_thw=grids)
    err = rel_err(got, hf_logits(hf.eval(), ids, mask, pixels, grids), mask)
    assert err < RTOL, f"transformers on our checkpoint differs by {err:.3g} (relative)"

    loaded = from_pretrained(tmp_path / "ours")
    assert loaded.config == cfg
    a, b = ours.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def param_count(hf_config_dict: dict) -> int:
    """Parameters of the model of a config.json (built on the meta device)."""
    with torch.device("meta"):
        model = VisionLM(from_hf_config(hf_config_dict))
    return sum(p.numel() for p in model.parameters())


def random_vlm_checkpoint(conf_name: str, directory: Path):
    """A random-init checkpoint of conf/model/<conf_name>.yaml (the task tokenizer's vision tokens,
    an image processor of the tower's sizes) and a few examples of the visual task, as a run makes them."""
    from omegaconf import OmegaConf

    from miles.config.schema import ModelCfg
    from miles.data import shape_count
    from miles.orchestrate.checkpoints import random_checkpoint

    root = Path(__file__).resolve().parents[3]
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                OmegaConf.load(root / "conf" / "model" / f"{conf_name}.yaml")))
    examples = shape_count.examples(0, "train", 4)
    alphabet = "".join(sorted({c for e in examples for c in e.prompt + e.label}))
    return random_checkpoint(model, alphabet, 0, directory, chat=True), examples


def check_engine_and_trainer_match_transformers(conf_name: str, model_class, directory: Path) -> None:
    """The native engine generates for image prompts of a tiny random `conf_name` checkpoint: its
    sampled log-probs equal transformers' on prompt + response with the images, and the torch
    trainer recomputes them (packed rows, each sample with its own images)."""
    from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, RolloutCfg, TrainerCfg
    from miles.data.prompt_format import PromptFormat
    from miles.data.tokenizer import TokenizerInfo
    from miles.data.vision_inputs import VisionInputs
    from miles.rollout.native import NativeEngine
    from miles.trainer.torch_trainer import TorchTrainer
    from miles.types import build_train_batch

    directory, examples = random_vlm_checkpoint(conf_name, directory)
    tok = TokenizerInfo.load(directory)
    fmt = PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(directory, tok))
    encoded = [fmt.encode(e) for e in examples]
    images = [im for _, im in encoded]
    engine = NativeEngine(str(directory), RolloutCfg(max_new_tokens=6, temperature=1.0), DType.fp32, seed=0)
    samples = engine.generate([fmt(e) for e in examples], [e.label for e in examples], n=3,
                              prompt_ids=[ids for ids, _ in encoded], images=images)
    hf = model_class.from_pretrained(str(directory), dtype=torch.float32).eval()
    image_id = engine.model.config.vision.image_token_id
    checked = 0
    for s in samples:
        s.images = images[s.group]
        if image_id in s.response_ids:  # transformers would take it for an image placeholder
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = hf_logits(hf, ids, torch.ones_like(ids), s.images["pixel_values"], s.images["image_grid_thw"],
                           image_id)[0]
        p = len(s.prompt_ids)
        ref = torch.log_softmax(logits[p - 1:-1].float(), -1).gather(-1, ids[0, p:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), ref, atol=2e-6, rtol=0), (s.rollout_logprobs, ref)
        checked += 1
    assert checked >= 6

    precision = PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32)
    trainer = TorchTrainer(str(directory), AlgoCfg(name=AlgoName.grpo), TrainerCfg(), precision, temperature=1.0)
    batch = build_train_batch(samples, torch.zeros(len(samples)), engine.pad_id)
    assert (trainer.logprobs(batch) - batch.rollout_logprobs).abs().max() < 1e-5
