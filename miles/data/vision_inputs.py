"""From an example with images to what a vision-language model takes: token ids with one image
placeholder per merged patch, and the image processor's pixel_values / image_grid_thw.

    vision = VisionInputs.load(checkpoint_dir, tok)        # None: the checkpoint has no image processor
    ids, images = vision.encode(prompt_text, example.images)
    # images = {"pixel_values": [patches, C*tp*p*p], "image_grid_thw": [images, 3]}

The chat template writes each image part as `<|vision_start|><|image_pad|><|vision_end|>` (Qwen's
templates do; the tiny chat format of miles/data/tiny_chat.py too; GLM-4.5V's writes
`<|begin_of_image|><|image|><|end_of_image|>`); `encode` widens each image token (config.json's
`image_token_id`) to t * h * w / m^2 copies, m the merge size, as transformers' Qwen2.5-VL
processor does, so the model's image features fill them one to one. Pixels come from the
checkpoint's own transformers image processor (preprocessor_config.json), never by hand.
A tiny model's checkpoint gets a processor of its vision config (`save_image_processor`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles.data.tokenizer import TokenizerInfo, encode_prompt

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

    @classmethod
    def load(cls, checkpoint_dir: str | Path, tok: TokenizerInfo) -> "VisionInputs | None":
        """The checkpoint's image processor and image token (its config.json's image_token_id);
        None without preprocessor_config.json (a text model)."""
        import transformers

        if not (Path(checkpoint_dir) / PROCESSOR_FILE).is_file():
            return None
        processor = transformers.AutoImageProcessor.from_pretrained(str(checkpoint_dir))
        image_token_id = json.loads((Path(checkpoint_dir) / "config.json").read_text())["image_token_id"]
        return cls(tok, processor, image_token_id, int(processor.merge_size))

    def pixels(self, images) -> dict[str, torch.Tensor]:
        out = self.processor(images=list(images), return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def encode(self, text: str, images) -> tuple[list[int], dict[str, torch.Tensor]]:
        """(prompt ids with the placeholders widened, the images' pixels) of a rendered prompt."""
        pixels = self.pixels(images)
        ids = encode_prompt(self.tok, text)
        counts = [int(t * h * w) // self.merge_size ** 2 for t, h, w in pixels["image_grid_thw"].tolist()]
        if ids.count(self.image_token_id) != len(counts):
            token = self.tok.tokenizer.id_to_token(self.image_token_id)
            raise ValueError(f"the prompt holds {ids.count(self.image_token_id)} image placeholders for "
                             f"{len(counts)} images: the chat template must write {token} once per image part")
        out, k = [], 0
        for i in ids:
            if i == self.image_token_id:
                out += [i] * counts[k]
                k += 1
            else:
                out.append(i)
        return out, pixels
