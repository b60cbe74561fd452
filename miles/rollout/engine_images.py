"""Images for the external engines (rollout=sglang, rollout=vllm; docs/rollout.md): the loop hands an
engine the processor's output for each prompt (`pixel_values`, `image_grid_thw`), while SGLang and vLLM
take images and run the checkpoint's processor themselves. So each image is rebuilt from its pixels
(the resized image, un-normalized and rounded to 8 bits: processing it again gives the same pixels)
and each image's run of placeholder tokens is sent as one placeholder, which the server widens again
by the image's grid.

    vision = vision_inputs(checkpoint_dir, tok)                        # the checkpoint's processor
    for ids, pictures in image_prompts(distinct, images, vision, family, "sglang"):
        ...                                                            # send ids + pictures (PIL)
"""

from __future__ import annotations

import base64
import io

import numpy as np

from miles.data.tokenizer import TokenizerInfo


def vision_inputs(checkpoint_dir: str, tok: TokenizerInfo):
    """The checkpoint's image processor and placeholder (miles/data/vision_inputs.py), which the server
    loads from the same preprocessor_config.json (also vLLM's engine)."""
    from miles.data.vision_inputs import PROCESSOR_FILE, VisionInputs

    vision = VisionInputs.load(checkpoint_dir, tok)
    if vision is None:
        raise ValueError(f"{checkpoint_dir} is a vision-language checkpoint without {PROCESSOR_FILE}: the "
                         "external engines process images with it")
    return vision


def image_prompts(distinct: list[list[int]], images: list[dict | None] | None, vision, family: str,
                  engine: str) -> list[tuple[list[int], list | None]]:
    """Per prompt, what an external engine is sent: (its ids with one placeholder per image, its images
    rebuilt as PIL images), or (its ids, None) without images. `images` as NativeEngine.generate takes
    them; `vision` the checkpoint's VisionInputs (None: a text model)."""
    if images is None or all(im is None for im in images):
        return [(ids, None) for ids in distinct]
    if vision is None:
        raise ValueError(f"generate: images given to a text model ({family}); use a vision-language checkpoint "
                         "(e.g. model=qwen2_5_vl_tiny)")
    if len(images) != len(distinct):
        raise ValueError(f"images: one entry (or None) per prompt, got {len(images)} for {len(distinct)} prompts")
    out = []
    for ids, inputs in zip(distinct, images):
        if inputs is None:
            out.append((ids, None))
            continue
        if set(inputs) != {"pixel_values", "image_grid_thw"}:
            raise ValueError(f"images: rollout={engine} sends images only ({sorted(inputs)} given; videos run on "
                             "rollout=native)")
        counts = [t * h * w // vision.merge_size ** 2 for t, h, w in inputs["image_grid_thw"].tolist()]
        out.append((one_placeholder_per_image(ids, vision.image_token_id, counts),
                    rebuild_images(inputs, vision.processor)))
    return out


def one_placeholder_per_image(ids: list[int], image_token: int, counts: list[int]) -> list[int]:
    """`ids` with each image's run of `counts[k]` placeholders written once, as the chat template
    writes it (the server widens it again by the image's grid). ValueError when the runs are not the
    images' (the prompt was not encoded with these images)."""
    out, runs, i = [], [], 0
    while i < len(ids):
        j = i
        while j < len(ids) and ids[j] == image_token:
            j += 1
        if j > i:
            runs.append(j - i)
            out.append(image_token)
            i = j
        else:
            out.append(ids[i])
            i += 1
    if runs != counts:
        raise ValueError(f"images: the prompt's image placeholder runs {runs} are not its images' token counts "
                         f"{counts} (image_grid_thw / merge size^2)")
    return out


def rebuild_images(inputs: dict, processor) -> list:
    """The PIL images whose processing by `processor` (the Qwen2-VL / GLM-4V image processors' layout:
    [patches, C * temporal_patch * patch^2] rows in 2 x 2-merge order, each frame repeated temporally)
    gives `inputs["pixel_values"]` back: the resized images, un-normalized and rounded to 8 bits.
    Exact for images the processor made (8-bit pixels, resize done), and a fixed point of its resize."""
    from PIL import Image

    ps, tp, m = int(processor.patch_size), int(processor.temporal_patch_size), int(processor.merge_size)
    mean = np.asarray(processor.image_mean, np.float64)[:, None, None]
    std = np.asarray(processor.image_std, np.float64)[:, None, None]
    pixels, start, out = inputs["pixel_values"].double().numpy(), 0, []
    for t, h, w in inputs["image_grid_thw"].tolist():
        x = pixels[start:start + t * h * w]
        start += t * h * w
        channels = x.shape[1] // (tp * ps * ps)
        # rows (h/m, w/m, m, m), columns (C, tp, p, p): the first frame of the first temporal slice
        x = x.reshape(t, h // m, w // m, m, m, channels, tp, ps, ps)[0, ..., 0, :, :]
        x = x.transpose(4, 0, 2, 5, 1, 3, 6).reshape(channels, h * ps, w * ps)
        x = (x * std + mean) / processor.rescale_factor
        out.append(Image.fromarray(np.clip(np.rint(x), 0, 255).astype(np.uint8).transpose(1, 2, 0)))
    return out


def png_data_uri(image) -> str:
    """A lossless data URI, one of the forms SGLang's load_image takes."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
