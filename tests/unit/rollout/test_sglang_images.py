"""Images through the SGLang adapter (miles/rollout/sglang_engine.py) against the local STAND-IN server
(sglang_standin.py), NOT SGLang: SGLang is MOCKED here (it cannot run on this CPU machine). The stand-in
implements SGLang 0.5.23's documented `image_data` of /generate (one list of images per input row, data
URIs / base64 / paths) and its Qwen-VL processor's widening of one placeholder per image, over the native
engine's vision-language path. So these tests hold the adapter to the request (each prompt's images, its
placeholders written once, rows aligned with n), to outputs equal to the native engine given the same
images (the stand-in computes with the native kernels: this checks that the pixels arrive as the trainer
has them, not SGLang's numerics), and to a checked sync that carries the vision tower.
"""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sglang_standin as standin
from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data import shape_count
from miles.data.prompt_format import PromptFormat
from miles.data.tokenizer import TokenizerInfo
from miles.data.vision_inputs import VisionInputs
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.rollout.engine_images import one_placeholder_per_image, rebuild_images
from miles.rollout.sglang_engine import SGLangEngine
from miles.transport.checksum import WeightSyncError, checksum
from sglang_fixtures import ckpt, serve  # noqa: F401  (fixtures: the tiny dense checkpoint, stand-in servers)

CFG = RolloutCfg(max_new_tokens=5)
CONF = Path(__file__).resolve().parents[3] / "conf"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """A random tiny Qwen2.5-VL (conf/model/qwen2_5_vl_tiny.yaml, as a run writes it), its prompt format,
    and four shape-count examples."""
    from omegaconf import OmegaConf

    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                OmegaConf.load(CONF / "model" / "qwen2_5_vl_tiny.yaml")))
    examples = shape_count.examples(0, "train", 4)
    alphabet = "".join(sorted({c for e in examples for c in e.prompt + e.label}))
    path = str(random_checkpoint(model, alphabet, 0, tmp_path_factory.mktemp("qwen2_5_vl"), chat=True))
    tok = TokenizerInfo.load(path)
    return path, PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(path, tok)), examples


def encoded(fmt, examples):
    pairs = [fmt.encode(e) for e in examples]
    return [fmt(e) for e in examples], [e.label for e in examples], [ids for ids, _ in pairs], [im for _, im in pairs]


def greedy(engine, prompts, labels, ids, images, n=2):
    return engine.generate(prompts, labels, n=n, temperature=0.0, prompt_ids=ids, images=images)


def test_images_reach_the_server_as_the_trainer_has_them(vlm, serve):
    path, fmt, examples = vlm
    prompts, labels, ids, images = encoded(fmt, examples)
    images[2] = None  # a prompt without images in the same batch: its row carries none
    ids[2] = fmt.encode(shape_count.examples(5, "train", 1)[0])[0]
    ids[2] = [t for t in ids[2] if t != fmt.vision.image_token_id]
    server = serve(path)
    engine = SGLangEngine(path, CFG, DType.fp32, url=server.url)
    native = NativeEngine(path, CFG, DType.fp32, seed=0)
    got, want = greedy(engine, prompts, labels, ids, images), greedy(native, prompts, labels, ids, images)
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert [s.rollout_logprobs for s in got] == [s.rollout_logprobs for s in want]  # same kernels, same pixels
    assert [s.prompt_ids for s in got] == [s.prompt_ids for s in want]  # the widened prompts, as the trainer's

    body = server.bodies("/generate")[-1]
    token = fmt.vision.image_token_id
    assert len(body["image_data"]) == len(body["input_ids"]) == 2 * len(prompts)  # prompt-major rows, n = 2
    for row, (sent, data) in enumerate(zip(body["input_ids"], body["image_data"])):
        i = row // 2
        if images[i] is None:
            assert data is None and sent == ids[i]
            continue
        assert sent.count(token) == len(data) == 1  # one placeholder per image, as the template writes it
        assert data[0].startswith("data:image/png;base64,")


def test_rebuilt_images_process_to_the_same_pixels(vlm):
    """The PNGs sent are the processor's resized images: processed again (the server's side), they give the
    trainer's pixel_values bit for bit, for a task image and for sizes the processor resizes."""
    _, fmt, examples = vlm
    rng = np.random.default_rng(0)
    sources = [examples[0].images[0], Image.fromarray(rng.integers(0, 256, (100, 130, 3), dtype=np.uint8)),
               Image.fromarray(rng.integers(0, 256, (57, 300, 3), dtype=np.uint8))]
    inputs = fmt.vision.pixels(sources)
    rebuilt = rebuild_images(inputs, fmt.vision.processor)
    assert np.array_equal(np.asarray(rebuilt[0]), np.asarray(sources[0].convert("RGB")))  # 84 px: not resized
    again = fmt.vision.pixels(rebuilt)
    assert torch.equal(again["image_grid_thw"], inputs["image_grid_thw"])
    assert torch.equal(again["pixel_values"], inputs["pixel_values"])


def test_placeholders_must_be_the_images():
    assert one_placeholder_per_image([1, 7, 7, 7, 7, 2, 7, 2], 7, [4, 1]) == [1, 7, 2, 7, 2]
    with pytest.raises(ValueError, match=r"runs \[4\] are not its images' token counts \[4, 1\]"):
        one_placeholder_per_image([1, 7, 7, 7, 7, 2], 7, [4, 1])


def test_weight_sync_carries_the_vision_tower_checked(vlm, serve):
    """The trainer's whole state dict (decoder and tower) loads into the server, /weights_checker checks
    every tensor in SGLang's Qwen2.5-VL layout (the tower's qkv_proj, fused gate_up_proj weight and bias),
    and the images then give the native engine's outputs after the same update; a tower tensor that
    loads wrong fails the check."""
    path, fmt, examples = vlm
    prompts, labels, ids, images = encoded(fmt, examples)
    server = serve(path)
    engine = SGLangEngine(path, CFG, DType.fp32, url=server.url)
    native = NativeEngine(path, CFG, DType.fp32, seed=0)
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in native.model.state_dict().items()}
    before = [s.response_ids for s in greedy(engine, prompts, labels, ids, images)]
    assert engine.update_weights(state, checksum(state)) == checksum(state)
    native.update_weights(state)
    got, want = greedy(engine, prompts, labels, ids, images), greedy(native, prompts, labels, ids, images)
    assert [s.response_ids for s in got] == [s.response_ids for s in want] != before
    assert [s.rollout_logprobs for s in got] == [s.rollout_logprobs for s in want]
    checked = set(standin.sglang_parameters(server.hf_view(), server.hf_config, torch.float32))
    assert {"visual.blocks.0.attn.qkv_proj.weight", "visual.blocks.0.mlp.gate_up_proj.bias",
            "visual.patch_embed.proj.weight"} <= checked
    assert engine.last_check["checked"] == len(checked) and not engine.last_check["unchecked"]

    server.corrupt = "visual.blocks.0.attn.qkv.weight"
    with pytest.raises(WeightSyncError, match="qkv_proj"):
        engine.update_weights(state, checksum(state))


def test_bad_images_are_refused_naming_the_key(vlm, ckpt, serve):  # noqa: F811
    path, fmt, examples = vlm
    prompts, labels, ids, images = encoded(fmt, examples[:1])
    server = serve(path)
    engine = SGLangEngine(path, CFG, DType.fp32, url=server.url)
    with pytest.raises(ValueError, match="images: one entry"):
        engine.generate(prompts, labels, prompt_ids=ids, images=images * 2)
    with pytest.raises(ValueError, match="videos run on rollout=native"):
        engine.generate(prompts, labels, prompt_ids=ids, images=[{**images[0], "pixel_values_videos": None}])
    text = SGLangEngine(ckpt, CFG, DType.fp32, url=serve(ckpt).url)
    with pytest.raises(ValueError, match="images given to a text model"):
        text.generate(["1+2="], ["3"], images=images)
