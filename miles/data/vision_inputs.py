"""From an example with images and videos to what a vision-language model takes: token ids with
one placeholder per merged patch, and the processors' pixel_values / image_grid_thw (images) and
pixel_values_videos / video_grid_thw / second_per_grid_ts (videos: miles/data/videos.py).

    vision = VisionInputs.load(checkpoint_dir, tok)        # None: the checkpoint has no image processor
    ids, inputs = vision.encode(prompt_text, example.images)   # example.images: PIL images and Videos
    # inputs = {"pixel_values": [patches, C*tp*p*p], "image_grid_thw": [images, 3], (videos) ...}

The chat template writes each image part as `<|vision_start|><|image_pad|><|vision_end|>` (Qwen's
templates do; the tiny chat format of miles/data/tiny_chat.py too; GLM-4.5V's writes
`<|begin_of_image|><|image|><|end_of_image|>`) and each video part as
`<|vision_start|><|video_pad|><|vision_end|>` (GLM-4.5V: `<|begin_of_video|><|video|><|end_of_video|>`).
`encode` replaces them in the rendered text as transformers' processor of the family does, then
tokenizes: each image token (config.json's `image_token_id`) widened to t * h * w / m^2 copies, m
the merge size; each video's placeholder by the family's rule (`miles.data.videos.expand_video`:
per-frame spans with their time in the text for Qwen3-VL and GLM-4.5V), so the model's features fill
them one to one. Pixels come from the checkpoint's own transformers image processor
(preprocessor_config.json), never by hand; a video's frames too (miles/data/videos.py says why not
its video processor). A tiny model's checkpoint gets a processor of its vision config (`save_image_processor`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.data.tokenizer import TokenizerInfo, encode_prompt
from miles.data.videos import Video, VideoTokens, expand_video, video_pixels, video_placeholders

# The vision tokens of Qwen's tokenizers, in the order a random-init checkpoint's tokenizer adds them.
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"
VISION_TOKENS = (IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END)
PROCESSOR_FILE = "preprocessor_config.json"


def vision_token_ids(tok: TokenizerInfo) -> dict[str, int]:
    """The VisionConfig token-id fields of a tokenizer that carries Qwen's vision tokens."""
    ids = {name: tok.tokenizer.token_to_id(token) for name, token in
           (("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD),
            ("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END))}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer lacks the vision tokens {', '.join(VISION_TOKENS)} ({missing})")
    return ids


def random_init_image_processor(vision):
    """A transformers Qwen2VLImageProcessor of the tower's patch / merge sizes: what a random-init
    tiny checkpoint ships (`save_image_processor`), as a published one ships its own."""
    import transformers

    unit = vision.patch_size * vision.spatial_merge_size
    return transformers.Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
        merge_size=vision.spatial_merge_size,
        size={"shortest_edge": (2 * unit) ** 2, "longest_edge": (16 * unit) ** 2})


def save_image_processor(vision, out: str | Path) -> None:
    random_init_image_processor(vision).save_pretrained(str(out))


@dataclass
class VisionInputs:
    tok: TokenizerInfo
    processor: Any  # a transformers image processor
    image_token_id: int
    merge_size: int
    family: str = "qwen2_5_vl"  # config.json's model_type: how videos are written (miles.data.videos)
    video_tokens: VideoTokens | None = None  # None: the checkpoint takes no videos (see `load`)

    @classmethod
    def load(cls, checkpoint_dir: str | Path, tok: TokenizerInfo) -> "VisionInputs | None":
        """The checkpoint's image processor, family and vision tokens (config.json); None without
        preprocessor_config.json (a text model)."""
        import transformers

        if not (Path(checkpoint_dir) / PROCESSOR_FILE).is_file():
            return None
        processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint_dir))
        config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        return cls(tok, processor, config["image_token_id"], int(processor.merge_size), config["model_type"],
                   _video_tokens(config, tok))

    def pixels(self, images) -> dict[str, torch.Tensor]:
        out = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def encode(self, text: str, visuals) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(prompt ids with the placeholders widened, the images' and videos' inputs) of a rendered
        prompt; `visuals`: its parts' PIL images and Videos (miles/data/videos.py), in order."""
        images = [v for v in visuals if not isinstance(v, Video)]
        videos = [v for v in visuals if isinstance(v, Video)]
        inputs = self.pixels(images) if images else {}
        if videos:
            if self.video_tokens is None:
                raise ValueError(f"video prompts need a {self.family} checkpoint whose config.json and tokenizer "
                                 "name its video tokens (GLM-4.5V: video_start_token_id / video_end_token_id)")
            inputs.update(video_pixels(videos, self.processor, self.family))
        return encode_prompt(self.tok, self._expand(text, inputs, videos)), inputs

    def _expand(self, text: str, inputs: dict[str, torch.Tensor], videos: list[Video]) -> str:
        """`text` with each image token and each video placeholder replaced as the family's
        processor does, in one pass (a GLM video's frames are written with the image token)."""
        image_token = self.tok.tokenizer.id_to_token(self.image_token_id)
        marks = video_placeholders(self.family, self.video_tokens) if videos else []
        pattern = "|".join(re.escape(mark) for mark in [*marks, image_token])
        is_image = [m.group(0) == image_token for m in re.finditer(pattern, text)]
        grids = inputs.get("image_grid_thw", torch.empty(0, 3)).tolist()
        for kind, mark, given in (("image", image_token, len(grids)), ("video", marks and marks[-1], len(videos))):
            count = is_image.count(kind == "image")
            if count != given:
                raise ValueError(f"the prompt holds {count} {kind} placeholders for {given} {kind}s: "
                                 f"the chat template must write {mark} once per {kind} part")
        images = iter([image_token * (t * h * w // self.merge_size ** 2) for t, h, w in grids])
        tp = int(self.processor.temporal_patch_size)
        spans = iter([expand_video(self.family, video, grid, self.merge_size, tp, self.video_tokens)
                      for video, grid in zip(videos, inputs.get("video_grid_thw", torch.empty(0, 3)).tolist())])
        return re.sub(pattern, lambda m: next(images) if m.group(0) == image_token else next(spans), text)


def _video_tokens(config: dict, tok: TokenizerInfo) -> VideoTokens | None:
    """The token strings of the family's video placeholders, None where the checkpoint has none:
    GLM-4.5V tells a video's frames (image tokens) from images by its video span tokens alone."""
    start = config.get("vision_start_token_id", config.get("image_start_token_id"))
    end = config.get("vision_end_token_id", config.get("image_end_token_id"))
    ids = (config["image_token_id"], config.get("video_token_id"), start, end)
    spans = (config.get("video_start_token_id"), config.get("video_end_token_id"))
    names = [None if i is None else tok.tokenizer.id_to_token(i)
             for i in ids + (spans if config["model_type"] == "glm4v_moe" else ())]
    return None if None in names else VideoTokens(*names[:4])
