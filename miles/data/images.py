"""Image (and video) prompts: records whose prompt is a messages list with image or video parts,
from .jsonl or .parquet.

    {"prompt": [{"role": "user", "content": [{"type": "image", "image": "shapes/0001.png"},
                                              {"type": "video", "video": "clips/0001", "fps": 2},
                                              {"type": "text", "text": "How many red shapes?"}]}],
     "label": "3"}

An image part's "image" is a path (relative to the data file's directory), a `data:image/...;base64,`
URI or bare base64; a video part's "video" a directory of frames or a list of frame paths, with
the frames' "fps" (miles/data/videos.py). Every image and frame is opened and decoded on load, so a
missing or unreadable one fails before any rollout, with the file and the 1-based line (JSONL) or
row (Parquet); no record is ever skipped. Pixels are prepared by the family's transformers image
processor (`preprocess`), never by hand: its output is what the model's vision tower was trained on.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from miles.data.example import Example
from miles.data.prompts import DataError, jsonl_records
from miles.data.videos import Video, read_video


@dataclass(frozen=True)
class ImageExample:
    messages: tuple[dict, ...]  # image / video parts reduced to {"type": ...}: the chat template's placeholders
    images: tuple[Image.Image | Video, ...]  # the images (RGB) and videos, in the order their parts appear
    label: str
    where: str  # "file, line n" / "file, row n": for errors raised later (e.g. by a reward)


def load_image_file(path: str | Path, prompt_key: str = "prompt", label_key: str = "label") -> list[ImageExample]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    if path.suffix == ".jsonl":
        records = jsonl_records(path)
    elif path.suffix == ".parquet":
        records = ((f"{path}, row {i}", _drop_nulls(r)) for i, r in enumerate(pq.read_table(path).to_pylist(), 1))
    else:
        raise DataError(f"{path}: image data must be .jsonl or .parquet")
    return [_example(record, prompt_key, label_key, path.parent, where) for where, record in records]


def to_example(ex: ImageExample) -> Example:
    """The run's Example of an image record: its messages and images; `prompt` (for logs) the text
    of its last user turn."""
    last_user = next(m for m in reversed(ex.messages) if m.get("role") == "user")
    content = last_user["content"]
    text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
    return Example(prompt=text, label=ex.label, messages=ex.messages, images=ex.images)


def preprocess(images: list[Image.Image], processor) -> dict[str, Any]:
    """pixel_values [patches, C * tp * p * p] and image_grid_thw [images, 3] from the family's image
    processor (e.g. transformers.Qwen2VLImageProcessor), the inputs of miles.models.vlm.VisionLM."""
    out = processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def _drop_nulls(value: Any) -> Any:
    """Parquet stores content parts as structs holding every part's keys; None marks the absent ones."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _example(record: dict, prompt_key: str, label_key: str, base: Path, where: str) -> ImageExample:
    for key in (prompt_key, label_key):
        if key not in record:
            raise DataError(f"{where}: missing key {key!r} (keys present: {sorted(record)})")
    messages = record[prompt_key]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {prompt_key!r} must be a non-empty messages list")
    out, images = [], []
    for i, message in enumerate(messages, 1):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            out.append(message)
            continue
        if not isinstance(content, list):
            raise DataError(f"{where}: message {i} has no string or list 'content': {message!r}")
        parts = []
        for part in content:
            if part.get("type") == "image":
                images.append(_read_image(part.get("image"), base, where))
                parts.append({"type": "image"})
            elif part.get("type") == "video":
                images.append(read_video(part, base, where))
                parts.append({"type": "video"})
            elif part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise DataError(f"{where}: message {i} has a part that is not an image, video or text: {part!r}")
        out.append({**message, "content": parts})
    label = record[label_key]
    if not isinstance(label, (str, int)) or isinstance(label, bool):
        raise DataError(f"{where}: {label_key!r} must be a string or an integer, got {label!r}")
    return ImageExample(tuple(out), tuple(images), str(label), where)


def _read_image(ref: Any, base: Path, where: str) -> Image.Image:
    if not isinstance(ref, str) or not ref:
        raise DataError(f"{where}: image part has no 'image' string: {ref!r}")
    if ref.startswith("data:"):
        try:
            data, name = base64.b64decode(ref.split(",", 1)[-1], validate=True), "inline data URI"
        except (binascii.Error, ValueError):
            raise DataError(f"{where}: data URI image is not valid base64") from None
    elif (base / ref).is_file():
        data, name = (base / ref).read_bytes(), str(base / ref)
    else:  # bare base64; a path (with "." or other non-base64 characters) that does not exist fails here
        try:
            data, name = base64.b64decode(ref, validate=True), f"(no file {base / ref}; read as base64)"
        except (binascii.Error, ValueError):
            raise DataError(f"{where}: image file {base / ref} not found") from None
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: unreadable image {name}: {e}") from None
    return image.convert("RGB")

