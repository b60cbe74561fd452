"""Video parts of prompt records (miles/data/images.py reads the records), and what a
vision-language model takes of them.

    {"type": "video", "video": "clips/0001", "fps": 2}                      # a directory of frames
    {"type": "video", "video": ["f/0.png", "f/1.png", "f/2.png"], "fps": 2}  # frame files, in order

Paths are relative to the data file's directory. A directory's frames are its files in natural
name order (frame_2 before frame_10); every one must be an image. `fps`: the rate the frames were
sampled at, so frame i is at i / fps seconds; required. All frames of a video share one size.
Video files (.mp4, ...) need a decoder, and none is installed with the project (PyAV, decord,
torchvision, torchcodec): such a part is an error; extract the frames first, e.g.
`ffmpeg -i clip.mp4 -vf fps=2 clip/%04d.png`.

Pixels: transformers 5's video processors (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor,
Glm4vVideoProcessor) resize and normalize with torchvision, which has no build for the project's
CPU torch. The frames therefore go through the checkpoint's image processor (transformers, PIL
backend: resize, rescale, normalize) and are grouped into temporal patches of
`temporal_patch_size` frames in the video processors' patch layout (`group_frames`; the last frame
repeated to fill the last patch, as they do). The pixels are the video processor's where no resize
is needed; a resized frame differs by PIL's bicubic against torchvision's, and the image
processor's pixel limits apply per frame. No frames are dropped or resampled: the given frames are
the sampled ones.

The prompt text: each family's processor rule (transformers' replace_video_token), `expand_video`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

from miles.data.prompts import DataError

VIDEO_FILES = (".mp4", ".mkv", ".webm", ".avi", ".mov", ".m4v")
# Families whose processors write one span per temporal patch with its time in the text.
TIMESTAMP_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "glm4v_moe")


@dataclass(frozen=True)
class Video:
    frames: tuple[Image.Image, ...]  # RGB, one size, in time order
    fps: float  # frames per second of `frames`


def read_video(part: dict, base: Path, where: str) -> Video:
    """The frames and fps of a video part; DataError naming `where` (file and line) otherwise."""
    ref, fps = part.get("video"), part.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0:
        raise DataError(f"{where}: video part needs \"fps\", a positive number (the frames' rate), got {fps!r}")
    frames = [_read_frame(path, where) for path in _frame_paths(ref, base, where)]
    sizes = sorted({f.size for f in frames})
    if len(sizes) > 1:
        raise DataError(f"{where}: the frames of video {ref!r} differ in size ({sizes}): resize them to one size")
    return Video(tuple(frames), float(fps))


def _frame_paths(ref: Any, base: Path, where: str) -> list[Path]:
    if isinstance(ref, list) and ref and all(isinstance(r, str) and r for r in ref):
        return [base / r for r in ref]
    if not isinstance(ref, str) or not ref:
        raise DataError(f"{where}: video part needs \"video\": a directory of frames or a non-empty list of "
                        f"frame paths, got {ref!r}")
    path = base / ref
    if path.suffix.lower() in VIDEO_FILES:
        raise DataError(f"{where}: video file {path}: no video decoder is installed (PyAV, decord, torchvision); "
                        "give a directory of its frames instead (e.g. ffmpeg -i in.mp4 -vf fps=2 dir/%04d.png)")
    if not path.is_dir():
        raise DataError(f"{where}: video frame directory {path} not found")
    frames = sorted((p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")),
                    key=lambda p: _natural_key(p.name))
    if not frames:
        raise DataError(f"{where}: video frame directory {path} holds no frames")
    return frames


def _natural_key(name: str) -> list:
    """frame_2 before frame_10: digit runs compare as numbers."""
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


def _read_frame(path: Path, where: str) -> Image.Image:
    if not path.is_file():
        raise DataError(f"{where}: video frame {path} not found")
    try:
        frame = Image.open(path)
        frame.load()
    except (UnidentifiedImageError, OSError) as e:
        raise DataError(f"{where}: unreadable video frame {path}: {e}") from None
    return frame.convert("RGB")


def video_pixels(videos: list[Video], processor, family: str) -> dict[str, torch.Tensor]:
    """pixel_values_videos [patches, C * tp * p * p], video_grid_thw [videos, 3] and (Qwen2.5-VL)
    second_per_grid_ts [videos] (seconds per temporal patch, tp / fps): the keys transformers'
    processors give, the inputs of miles.models.vlm.VisionLM."""
    tp = int(processor.temporal_patch_size)
    rows, grids = [], []
    for video in videos:
        frames = list(video.frames) + [video.frames[-1]] * (-len(video.frames) % tp)
        out = processor(images=frames, return_tensors="pt")
        rows.append(group_frames(out["pixel_values"], len(frames), tp))
        _, h, w = out["image_grid_thw"][0].tolist()
        grids.append([len(frames) // tp, h, w])
    out = {"pixel_values_videos": torch.cat(rows), "video_grid_thw": torch.tensor(grids)}
    if family not in TIMESTAMP_FAMILIES:
        out["second_per_grid_ts"] = torch.tensor([tp / v.fps for v in videos])  # float32, as transformers
    return out


def group_frames(frame_rows: torch.Tensor, frames: int, tp: int) -> torch.Tensor:
    """The image processor's rows of `frames` equal-size frames ([frames * hw, C * tp * p * p], each
    frame's patch repeated tp times) -> the video's rows [frames / tp * hw, C * tp * p * p]: temporal
    patch k holds frames k * tp ... k * tp + tp - 1, each patch's values ordered (C, tp, p, p) as
    the video processors' patchify lays them out."""
    hw, dim = frame_rows.shape[0] // frames, frame_rows.shape[1]
    channels = 3  # frames are read as RGB
    per_frame = frame_rows.view(frames, hw, channels, tp, dim // (channels * tp))[:, :, :, 0]  # [F, hw, C, pp]
    grouped = per_frame.view(frames // tp, tp, hw, channels, -1).permute(0, 2, 3, 1, 4)  # [T, hw, C, tp, pp]
    return grouped.reshape(frames // tp * hw, dim)


@dataclass(frozen=True)
class VideoTokens:
    """The token strings a family's video placeholders are written with."""
    image: str
    video: str
    start: str  # an image's (GLM) / a frame's (Qwen3-VL) span opening
    end: str


def expand_video(family: str, video: Video, grid: list[int], merge_size: int, tp: int, tokens: VideoTokens) -> str:
    """What the family's processor writes for one video in place of its chat template placeholder
    (`video_placeholders`): Qwen2.5-VL the video token t * h * w / m^2 times; Qwen3-VL per temporal
    patch `<{t:.1f} seconds>` + start + video token x h * w / m^2 + end; GLM-4.5V per temporal patch
    start + image token x h * w / m^2 + end + whole seconds."""
    t, h, w = grid
    per_frame = h * w // merge_size ** 2
    if family not in TIMESTAMP_FAMILIES:
        return tokens.video * (t * per_frame)
    if family == "glm4v_moe":
        # transformers' Glm4vProcessor: every second frame's time (timestamps[::2]), truncated to seconds.
        seconds = [i / video.fps for i in range(len(video.frames))][::2][:t]
        seconds += seconds[-1:] * (t - len(seconds))
        return "".join(f"{tokens.start}{tokens.image * per_frame}{tokens.end}{int(s)}" for s in seconds)
    return "".join(f"<{s:.1f} seconds>{tokens.start}{tokens.video * per_frame}{tokens.end}"
                   for s in patch_times(len(video.frames), video.fps, tp))


def patch_times(frames: int, fps: float, tp: int) -> list[float]:
    """Qwen3-VL's time of each temporal patch: the mean of its first and last frame's (frame i at
    i / fps; the last frame repeated to fill the last patch), transformers' _calculate_timestamps."""
    indices = list(range(frames)) + [frames - 1] * (-frames % tp)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + tp - 1]) / 2 for i in range(0, len(times), tp)]


def video_placeholders(family: str, tokens: VideoTokens) -> list[str]:
    """The chat template's placeholders of a video part that the family's processor replaces, the
    first that matches taken: Qwen3-VL's wrapper `start video end` (each frame gets its own span), or
    the video token alone (GLM's template writes it between its video start / end tokens)."""
    wrapper = [f"{tokens.start}{tokens.video}{tokens.end}"] if family in ("qwen3_vl", "qwen3_vl_moe") else []
    return wrapper + [tokens.video]
