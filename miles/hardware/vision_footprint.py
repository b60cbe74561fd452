"""What a vision-language model's tower costs the memory planner: its parameters (counted on the
meta device from the real tower, miles.models.vlm.TOWERS) and the image tokens of one prompt.

A prompt's images become `patches` ViT tokens, and each m x m block of them one merged token that
sits in the decoder's sequence (so the decoder's KV cache and activations already count them within
rollout.max_prompt_len; the planner adds the tower's own work on the patches). How many depends on
the image size, which the plan names (`ImageTokens.source`):
  task.kind=shape_count  the task's fixed image size, through the run's image processor;
  task.kind=images       the largest prompt of task.train_file, its images and videos through the
                         run's processor (the file read at plan time, as the run reads it); a file
                         not readable then: rollout.max_prompt_len bounds a prompt's merged tokens;
  text tasks             no images (the tower's weights still count).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from miles.config.schema import RunCfg, TaskKind
from miles.hardware.footprint import ACT_BYTES_PER_HIDDEN, DTYPE_BYTES, train_bytes_per_param
from miles.models.config import ArchConfig, VisionConfig

# Memoized (ArchConfig is not hashable: keyed by its repr): the planner asks for every layout it tries.
_PARAMS: dict[str, int] = {}
_GRIDS: dict[tuple, tuple[int, int, int]] = {}


@dataclass(frozen=True)
class ImageTokens:
    patches: int  # ViT tokens of one prompt's images
    merged: int  # decoder tokens they become (patches / merge_size^2)
    source: str  # where the image size comes from, for the plan table


def tower_params(arch: ArchConfig) -> int:
    """Parameters of the family's vision tower (0 for a text model)."""
    if arch.vision is None:
        return 0
    key = repr(arch)
    if key not in _PARAMS:
        from miles.models.vlm import TOWERS

        with torch.device("meta"):
            tower = TOWERS[arch.family](arch.vision)
        _PARAMS[key] = sum(p.numel() for p in tower.parameters())
    return _PARAMS[key]


def train_vision_bytes(cfg: RunCfg, arch: ArchConfig, tp: int, dp: int, sequences: int) -> dict[str, float]:
    """Bytes per training device the tower adds (keys of the planner's train items): its weights,
    sharded by TP like the decoder's dense layers (on the first pipeline stage); trained
    (trainer.freeze_vision false), fp32 gradients and AdamW state over the `dp` replicas too;
    and its activations over the images of a micro-batch's `sequences` (each sample carries its
    prompt's images): every block's kept for backward when trained, one block's at a time when
    frozen (no input needs a gradient, so autograd records nothing)."""
    w, g, o = train_bytes_per_param(cfg.precision)
    params = tower_params(arch) / tp
    trained = not cfg.trainer.freeze_vision
    patches = sequences * image_tokens(cfg, arch).patches
    blocks = arch.vision.depth if trained else 1
    return {"weights": params * w, "gradients": params * g if trained else 0.0,
            "optimizer": params * o / dp if trained else 0.0,
            "vision activations": tower_activation_bytes(arch.vision, patches, blocks,
                                                         DTYPE_BYTES[cfg.precision.train_dtype], tp)}


def rollout_vision_bytes(cfg: RunCfg, arch: ArchConfig, gpus_per_engine: int) -> dict[str, float]:
    """Bytes per rollout device the tower adds: its weights in the rollout dtype (the quantized
    recipes' rules are written for decoder layers: counted unquantized, an upper bound) and one
    tower call's activations. The engine runs the tower once per prompt, over all the prompts of a
    generate call at once: a step's rollout.batch_size, or the held-out split where the eval sends
    it whole (task.eval_size of shape_count; an image file's length is not known here)."""
    dtype = DTYPE_BYTES[cfg.precision.rollout_dtype]
    prompts = cfg.rollout.batch_size
    if cfg.task.kind == TaskKind.shape_count:
        prompts = max(prompts, cfg.task.eval_size)
    patches = prompts * image_tokens(cfg, arch).patches
    return {"vision weights": tower_params(arch) * dtype / gpus_per_engine,
            "vision activations": tower_activation_bytes(arch.vision, patches, 1, dtype, gpus_per_engine)}


def tower_activation_bytes(vision: VisionConfig, patches: int, blocks: int, dtype_bytes: int, tp: int) -> float:
    """`blocks` ViT blocks' activations over `patches` patches (the decoder's 34 x hidden bytes per
    token and layer, sharded by TP), plus the attention masks: the towers build [patches x patches]
    boolean masks over every image of a call (miles/models/vision.py: full and windowed), which
    scaled_dot_product_attention turns into an additive bias of the compute dtype."""
    layers = blocks * patches * vision.hidden_size * ACT_BYTES_PER_HIDDEN * dtype_bytes / 2 / tp
    return layers + patches ** 2 * (2 + dtype_bytes)


def image_tokens(cfg: RunCfg, arch: ArchConfig) -> ImageTokens:
    """One prompt's image tokens under the run's task (see the module docstring)."""
    merge = arch.vision.spatial_merge_size ** 2
    kind = cfg.task.kind
    if kind == TaskKind.shape_count:
        from miles.data.shape_count import IMAGE_SIDE

        t, h, w = image_grid(cfg, arch, IMAGE_SIDE, IMAGE_SIDE)
        patches = t * h * w
        return ImageTokens(patches, patches // merge,
                           f"one {IMAGE_SIDE} x {IMAGE_SIDE} px image per prompt (shape_count's size): "
                           f"{h} x {w} patches -> {patches // merge} image tokens")
    if kind == TaskKind.images:
        path = Path(cfg.task.train_file) if cfg.task.train_file else None
        if path is not None and path.is_file():
            return file_image_tokens(cfg, arch, path)
        bound = cfg.rollout.max_prompt_len
        return ImageTokens(bound * merge, bound,
                           f"at most rollout.max_prompt_len={bound} image tokens ({bound * merge:,} patches) per "
                           f"prompt: task.kind=images, {cfg.task.train_file} not readable at plan time")
    return ImageTokens(0, 0, f"no images (task.kind={kind.value})")


def file_image_tokens(cfg: RunCfg, arch: ArchConfig, path: Path) -> ImageTokens:
    """The largest prompt of an image / video prompt file: its images' and videos' patches through the
    run's processor (a video's frames as images, ceil(frames / temporal_patch_size) temporal patches).
    The file is read as the run reads it, so a bad record fails here as it would there."""
    from miles.data.images import load_image_file
    from miles.data.videos import Video

    merge = arch.vision.spatial_merge_size ** 2
    temporal = arch.vision.temporal_patch_size

    def patches(part) -> int:
        frame = part.frames[0] if isinstance(part, Video) else part
        _, h, w = image_grid(cfg, arch, frame.height, frame.width)
        return h * w * (-(-len(part.frames) // temporal) if isinstance(part, Video) else 1)

    examples = load_image_file(path, cfg.task.prompt_key, cfg.task.label_key)
    largest = max((sum(patches(part) for part in ex.images) for ex in examples), default=0)
    return ImageTokens(largest, largest // merge,
                       f"the largest of {path.name}'s {len(examples):,} prompts: {largest:,} patches -> "
                       f"{largest // merge:,} image / video tokens")


def image_grid(cfg: RunCfg, arch: ArchConfig, height: int, width: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid the run's image processor gives a height x width image: the checkpoint's
    own (preprocessor_config.json) or the one a random init ships, so resizing is the family's."""
    ckpt = cfg.model.hf_checkpoint
    key = (repr(arch.vision), ckpt, height, width)
    if key not in _GRIDS:
        from PIL import Image

        processor = _image_processor(arch, ckpt)
        grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        _GRIDS[key] = tuple(int(v) for v in grid.tolist())
    return _GRIDS[key]


def _image_processor(arch: ArchConfig, checkpoint: str | None):
    from miles.data.vision_inputs import PROCESSOR_FILE, random_init_image_processor

    if checkpoint and (Path(checkpoint) / PROCESSOR_FILE).is_file():
        import transformers

        return transformers.AutoImageProcessor.from_pretrained(checkpoint)
    return random_init_image_processor(arch.vision)
