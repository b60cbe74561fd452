"""Video parts of prompt records (miles.data.videos via miles.data.images): a directory of frames
or a list of frame files with their fps, JSONL and Parquet; errors naming the file and line for a
missing, empty, unreadable, mixed-size or undecodable video; the frames' pixels grouped into
temporal patches exactly as transformers' video processors lay them out; each family's prompt text
as transformers' processor writes it; and a record's prompt through a tiny random checkpoint gives
transformers' logits (the placeholders and the pixels agree)."""

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
from omegaconf import OmegaConf
from PIL import Image
from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor
from transformers.video_utils import VideoMetadata

from miles.data.images import load_image_file, to_example
from miles.data.prompt_format import PromptFormat
from miles.data.prompts import DataError
from miles.data.tokenizer import TokenizerInfo
from miles.data.videos import Video, VideoTokens, expand_video, group_frames, video_pixels
from miles.data.vision_inputs import VisionInputs

ROOT = Path(__file__).resolve().parents[3]
QWEN = VideoTokens("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
GLM = VideoTokens("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>")


def _frames(directory: Path, names, size=(56, 84)):
    directory.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        Image.new("RGB", size, (40 * k % 256, 0, 255 - 40 * k % 256)).save(directory / name)


def _record(video, fps=2, label="1"):
    return {"prompt": [{"role": "user", "content": [{"type": "video", "video": video, "fps": fps},
                                                    {"type": "text", "text": "How many?"}]}],
            "label": label}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_frame_directory_and_frame_list_load_in_order(tmp_path):
    _frames(tmp_path / "clip", ["f_10.png", "f_2.png", "f_1.png"])  # natural order: 1, 2, 10
    path = _write_jsonl(tmp_path / "d.jsonl", [_record("clip", fps=3),
                                               _record(["clip/f_10.png", "clip/f_1.png"], fps=0.5, label="2")])
    first, second = load_image_file(path)
    video = first.images[0]
    assert isinstance(video, Video) and (len(video.frames), video.fps) == (3, 3.0)
    blues = [f.getpixel((0, 0))[2] for f in video.frames]
    assert blues == [255 - 80, 255 - 40, 255]  # f_1 (written third), f_2, f_10
    assert [f.getpixel((0, 0))[2] for f in second.images[0].frames] == [255, 255 - 80]
    assert first.messages[0]["content"] == [{"type": "video"}, {"type": "text", "text": "How many?"}]
    assert to_example(first).images == first.images


def test_parquet_matches_jsonl(tmp_path):
    _frames(tmp_path / "clip", ["0.png", "1.png"])
    records = [_record("clip"), _record("clip", fps=4, label="3")]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "d.parquet")
    got = load_image_file(tmp_path / "d.parquet")
    want = load_image_file(_write_jsonl(tmp_path / "d.jsonl", records))
    assert [(e.messages, e.label, e.images[0].fps) for e in got] == [(e.messages, e.label, e.images[0].fps)
                                                                     for e in want]
    assert got[1].where.endswith("d.parquet, row 2")


@pytest.mark.parametrize("video, fps, message", [
    ("nope", 2, r"line 2: video frame directory .*nope not found"),
    ("empty", 2, r"line 2: video frame directory .*empty holds no frames"),
    ("bad", 2, r"line 2: unreadable video frame .*bad/1\.png"),
    (["clip/0.png", "clip/9.png"], 2, r"line 2: video frame .*clip/9\.png not found"),
    ("mixed", 2, r"line 2: the frames of video 'mixed' differ in size"),
    ("clip.mp4", 2, r"line 2: video file .*clip\.mp4: no video decoder is installed"),
    ("clip", None, r"line 2: video part needs \"fps\", a positive number"),
    ("clip", 0, r"line 2: video part needs \"fps\""),
    ([], 2, r"line 2: video part needs \"video\""),
])
def test_bad_video_names_file_and_line(tmp_path, video, fps, message):
    _frames(tmp_path / "clip", ["0.png", "1.png"])
    (tmp_path / "empty").mkdir()
    _frames(tmp_path / "bad", ["0.png"])
    (tmp_path / "bad" / "1.png").write_bytes(b"not a png")
    _frames(tmp_path / "mixed", ["0.png"])
    _frames(tmp_path / "mixed", ["1.png"], size=(28, 28))
    (tmp_path / "clip.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")
    part = _record(video, fps)
    if fps is None:
        del part["prompt"][0]["content"][0]["fps"]
    path = _write_jsonl(tmp_path / "d.jsonl", [_record("clip"), part])
    with pytest.raises(DataError, match=r"d\.jsonl, " + message):
        load_image_file(path)


def test_temporal_patches_are_the_video_processors_layout():
    """Frames patchified one by one (as the image processor does, each repeated tp times) and
    grouped equal transformers' video patchify of the whole clip, value for value."""
    patchify = functools.partial(Glm4vVideoProcessor.patchify, None, patch_size=14, merge_size=2, temporal_patch_size=2)
    clip = torch.randn(1, 6, 3, 56, 84, generator=torch.Generator().manual_seed(0))
    want = patchify(clip)[0][0]
    per_frame = torch.cat([patchify(clip[:, f:f + 1].expand(1, 2, -1, -1, -1))[0][0] for f in range(6)])
    assert torch.equal(group_frames(per_frame, 6, 2), want)


def test_video_pixels_from_the_image_processor():
    """Three frames: the last is repeated to fill the second temporal patch; each frame's half of
    a patch is the image processor's pixels of that frame; Qwen2.5-VL's seconds per patch = 2 / fps."""
    processor = transformers.Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16},
                                                      patch_size=14, merge_size=2)
    frames = tuple(Image.new("RGB", (84, 56), (60 * k, 20, 0)) for k in range(3))
    out = video_pixels([Video(frames, 4.0)], processor, "qwen2_5_vl")
    assert out["video_grid_thw"].tolist() == [[2, 4, 6]] and out["second_per_grid_ts"].tolist() == [0.5]
    halves = out["pixel_values_videos"].view(2, 24, 3, 2, 196)
    for frame, (patch, half) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        alone = processor(images=[frames[min(frame, 2)]], return_tensors="pt")["pixel_values"].view(24, 3, 2, 196)
        assert torch.equal(halves[patch, :, :, half], alone[:, :, 0])
    assert "second_per_grid_ts" not in video_pixels([Video(frames, 4.0)], processor, "qwen3_vl")


@pytest.mark.parametrize("frames, fps", [(4, 2.0), (5, 3.0), (8, 0.5)])
def test_prompt_text_is_transformers_processors(frames, fps):
    """expand_video = each family's transformers processor's replace_video_token (driven here
    without its video processor, which needs torchvision)."""
    tp, merge = 2, 2
    t = -(-frames // tp)
    video = Video(tuple(Image.new("RGB", (4, 4)) for _ in range(frames)), fps)
    grid = [t, 4, 6]
    inputs = {"video_grid_thw": torch.tensor([grid]),
              "video_metadata": [VideoMetadata(total_num_frames=frames, fps=fps, frames_indices=list(range(frames)))]}
    video_processor = SimpleNamespace(merge_size=merge, temporal_patch_size=tp)

    qwen3 = SimpleNamespace(video_processor=video_processor, video_token=QWEN.video,
                            vision_start_token=QWEN.start, vision_end_token=QWEN.end)
    qwen3._calculate_timestamps = functools.partial(transformers.Qwen3VLProcessor._calculate_timestamps, qwen3)
    assert expand_video("qwen3_vl", video, grid, merge, tp, QWEN) == \
        transformers.Qwen3VLProcessor.replace_video_token(qwen3, inputs, 0)

    glm = SimpleNamespace(video_processor=video_processor, image_token=GLM.image)
    glm.replace_frame_token_id = functools.partial(transformers.Glm4vProcessor.replace_frame_token_id, glm)
    assert expand_video("glm4v_moe", video, grid, merge, tp, GLM) == \
        transformers.Glm4vProcessor.replace_video_token(glm, inputs, 0)

    qwen2_5 = SimpleNamespace(video_processor=video_processor, video_token=QWEN.video)
    assert expand_video("qwen2_5_vl", video, grid, merge, tp, QWEN) == \
        transformers.Qwen2_5_VLProcessor.replace_video_token(qwen2_5, inputs, 0)


def _checkpoint(conf_name: str, directory: Path) -> Path:
    from miles.config.schema import ModelCfg
    from miles.orchestrate.checkpoints import random_checkpoint

    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg),
                                                OmegaConf.load(ROOT / "conf" / "model" / f"{conf_name}.yaml")))
    return random_checkpoint(model, "0123456789", 0, directory, chat=True)


def _image_and_video_record(tmp_path):
    _frames(tmp_path / "clip", ["0.png", "1.png", "2.png", "3.png"], size=(56, 56))
    Image.new("RGB", (56, 84), (0, 200, 0)).save(tmp_path / "still.png")
    record = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "still.png"},
                                                      {"type": "text", "text": "and"},
                                                      {"type": "video", "video": "clip", "fps": 3},
                                                      {"type": "text", "text": "?"}]}], "label": "1"}
    return load_image_file(_write_jsonl(tmp_path / "d.jsonl", [record]))[0]


@pytest.mark.parametrize("conf_name, model_class", [
    ("qwen2_5_vl_tiny", transformers.Qwen2_5_VLForConditionalGeneration),
    ("qwen3_vl_tiny", transformers.Qwen3VLForConditionalGeneration),
])
def test_a_record_through_a_checkpoint_gives_transformers_logits(tmp_path, conf_name, model_class):
    """An image and a 4-frame video: the placeholders are widened as the family writes them
    (Qwen3-VL: `<0.2 seconds>`, `<0.8 seconds>` before its two frame spans) and our model on the
    encoded prompt equals transformers' on the same ids and pixels."""
    from miles.models import from_pretrained

    directory = _checkpoint(conf_name, tmp_path / "init")
    example = to_example(_image_and_video_record(tmp_path))
    tok = TokenizerInfo.load(directory)
    vision = VisionInputs.load(directory, tok)
    ids, inputs = PromptFormat(tok, apply_chat_template=False, vision=vision).encode(example)
    ours = from_pretrained(directory).eval()
    v = ours.config.vision
    grid = inputs["video_grid_thw"][0].tolist()
    assert grid[0] == 2 and ids.count(v.video_token_id) == grid[0] * grid[1] * grid[2] // 4
    assert ids.count(v.image_token_id) == int(inputs["image_grid_thw"].prod()) // 4
    text = tok.tokenizer.decode(ids, skip_special_tokens=False)
    if conf_name == "qwen3_vl_tiny":
        assert "<0.2 seconds>" in text and "<0.8 seconds>" in text and text.count("<|vision_start|>") == 3
    else:
        assert inputs["second_per_grid_ts"].tolist() == pytest.approx([2 / 3])
    hf = model_class.from_pretrained(str(directory), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    types = (x == v.image_token_id).int() + 2 * (x == v.video_token_id).int()
    with torch.no_grad():
        got, ref = ours(x, **inputs), hf(input_ids=x, mm_token_type_ids=types, **inputs).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4


def test_glm_random_init_has_no_video_tokens(tmp_path):
    """A random-init GLM-4.5V checkpoint carries no video span tokens, which alone tell its video
    frames from images: a video prompt is refused, an image prompt still encodes."""
    directory = _checkpoint("glm4v_moe_tiny", tmp_path / "init")
    example = to_example(_image_and_video_record(tmp_path))
    tok = TokenizerInfo.load(directory)
    fmt = PromptFormat(tok, apply_chat_template=False, vision=VisionInputs.load(directory, tok))
    with pytest.raises(ValueError, match="video_start_token_id / video_end_token_id"):
        fmt.encode(example)
    image_only = {"prompt": [{"role": "user", "content": [{"type": "image", "image": "still.png"}]}], "label": "1"}
    ids, inputs = fmt.encode(to_example(load_image_file(_write_jsonl(tmp_path / "i.jsonl", [image_only]))[0]))
    assert set(inputs) == {"pixel_values", "image_grid_thw"} and len(ids) > int(inputs["image_grid_thw"].prod()) // 4
