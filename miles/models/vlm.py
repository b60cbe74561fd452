"""Vision-language model: the family's decoder (CausalLM, unchanged) plus a vision tower whose
merged patch features replace the image and video placeholder tokens' embeddings, with mRoPE positions.
The family picks the tower (TOWERS): Qwen2.5-VL's, Qwen3-VL's (dense and MoE decoders) or
GLM-4.5V's. Qwen3-VL's DeepStack features (inner tower blocks' merged outputs) are added to the
image tokens' hidden states after the first decoder layers, inside this forward, so the engine and
the trainer call every VLM alike.

    logits = VisionLM(cfg)(input_ids, pixel_values=..., image_grid_thw=...,
                           pixel_values_videos=..., video_grid_thw=..., second_per_grid_ts=...)

A prompt holds, per image, `<vision_start> <image_pad> x n <vision_end>` with n = t * h * w / m^2
(what the family's processor writes); images appear in `image_grid_thw` order across the batch,
videos in `video_grid_thw` order (the keys and layout of transformers' processors). A video's
placeholders, as each family's processor writes them:

  Qwen2.5-VL   one span of `<video_pad>` x t * h * w / m^2; mRoPE puts its temporal patches at
               temporal positions i * tokens_per_second * second_per_grid_t (seconds per patch);
  Qwen3-VL     one span per temporal patch, `<t seconds> <vision_start> <video_pad> x h * w / m^2
               <vision_end>`: each takes positions as a one-frame image, the time is in the text;
  GLM-4.5V     the same per temporal patch, but with the image token and an integer second after
               each span, all inside `<video_start> ... <video_end>` (config.json's ids), which
               alone tell a video's frames from images.

Without pixel inputs the model is its text decoder (mRoPE with three equal positions is RoPE).
A sampled response may hold an image or video token too (a tiny random model's does); `image_mask`
/ `video_mask` then say which placeholders the images / videos fill (the prompt's), the others are text.
"""

from __future__ import annotations

from typing import Optional

import torch

from miles.models.causal_lm import CausalLM
from miles.models.config import ArchConfig
from miles.models.vision import VisionTower, grid_list
from miles.models.vision_glm4v import Glm4vVisionTower
from miles.models.vision_qwen3 import Qwen3VisionTower

# family -> its vision tower: (pixel_values, image_grid_thw) -> [image tokens, (1 + k) * hidden], each
# token's merged features and then its k DeepStack features (k = 0 but for Qwen3-VL).
TOWERS = {"qwen2_5_vl": VisionTower, "qwen3_vl": Qwen3VisionTower, "qwen3_vl_moe": Qwen3VisionTower,
          "glm4v_moe": Glm4vVisionTower}
# Families whose processors write a video as one span per temporal patch (the time in the text):
# each span takes mRoPE positions as a one-frame image. Qwen2.5-VL's one span per video spreads the
# temporal patches over the temporal axis instead.
FRAME_SPANS = {"qwen3_vl", "qwen3_vl_moe", "glm4v_moe"}
# Families whose video frames are written with the image token, told apart by video span tokens.
FRAMES_AS_IMAGES = {"glm4v_moe"}


class VisionLM(CausalLM):
    def __init__(self, config: ArchConfig, seed: Optional[int] = None):
        if config.vision is None:
            raise ValueError(f"family {config.family}: VisionLM needs a vision block")
        super().__init__(config)
        if config.family not in TOWERS:
            raise ValueError(f"family {config.family}: no vision tower (vision-language families: {', '.join(TOWERS)})")
        self.visual = TOWERS[config.family](config.vision)
        # Again with the tower there, so that one seed reproduces every weight.
        self.init_weights(seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        pixel_values: Optional[torch.Tensor] = None,
        image_grid_thw: Optional[torch.Tensor] = None,
        mrope_position_ids: Optional[torch.Tensor] = None,
        image_mask: Optional[torch.Tensor] = None,
        pixel_values_videos: Optional[torch.Tensor] = None,
        video_grid_thw: Optional[torch.Tensor] = None,
        second_per_grid_ts: Optional[torch.Tensor] = None,
        video_mask: Optional[torch.Tensor] = None,
        **kwargs,
    ) -> torch.Tensor:
        """Logits [B, T, V]. pixel_values / image_grid_thw and pixel_values_videos / video_grid_thw /
        second_per_grid_ts: the processors' output for the batch's images and videos;
        mrope_position_ids [3, B, T] default to `mrope_positions` (left padding honoured through
        attention_mask); image_mask / video_mask [B, T]: the placeholders the images / videos fill
        (default: `placeholders`). Other arguments as CausalLM.forward."""
        embeds = self.embed_tokens(input_ids)
        image_slots, video_slots = placeholders(input_ids, self.config, image_mask, video_mask)
        inputs = [(name, pixels, grids, slots) for name, pixels, grids, slots in
                  (("image", pixel_values, image_grid_thw, image_slots),
                   ("video", pixel_values_videos, video_grid_thw, video_slots)) if pixels is not None]
        deepstack = []
        if inputs:
            # One tower call over images and videos (attention never crosses a frame): the engine
            # runs it once per prompt batch.
            out = self.visual(torch.cat([p for _, p, _, _ in inputs]), torch.cat([g for _, _, g, _ in inputs]))
            m2 = self.config.vision.spatial_merge_size ** 2
            parts = out.split([int(g.prod(-1).sum()) // m2 for _, _, g, _ in inputs])
            if pixel_values_videos is None and bool(video_slots.any()):  # e.g. a caller that drops the videos
                raise ValueError(f"{int(video_slots.sum())} video tokens in input_ids but no pixel_values_videos")
            for (name, _, grids, slots), part in zip(inputs, parts):
                if int(slots.sum()) != part.shape[0]:
                    raise ValueError(f"{int(slots.sum())} {name} tokens in input_ids but the {name}s give "
                                     f"{part.shape[0]} features (grids {grids.tolist()})")
            # Each token's merged features and DeepStack features, zero away from the placeholders
            # (adding DeepStack there leaves those hidden states bit for bit).
            placed = torch.zeros(*input_ids.shape, out.shape[-1], dtype=embeds.dtype, device=embeds.device)
            filled = torch.zeros_like(image_slots)
            for (_, _, _, slots), part in zip(inputs, parts):
                placed = placed.masked_scatter(slots[..., None], part.to(embeds.dtype))
                filled = filled | slots
            features, *deepstack = placed.split(self.config.hidden_size, dim=-1)
            embeds = torch.where(filled[..., None], features, embeds)
        if mrope_position_ids is None and kwargs.get("cache") is not None:
            # Tokens after an image sit at (prompt's last mRoPE position + 1 + step), which only the
            # caller that ran the prompt knows.
            raise ValueError("decoding with a cache needs mrope_position_ids (see mrope_positions)")
        if mrope_position_ids is None:
            mrope_position_ids = mrope_positions(input_ids, image_grid_thw, self.config, attention_mask, image_mask,
                                                 video_grid_thw, second_per_grid_ts, video_mask)
        return super().forward(input_ids, attention_mask, inputs_embeds=embeds,
                               mrope_position_ids=mrope_position_ids, layer_additions=deepstack, **kwargs)


def placeholders(input_ids: torch.Tensor, cfg: ArchConfig, image_mask: Optional[torch.Tensor] = None,
                 video_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] image placeholders, [B, T] video placeholders): the given masks; without any, every
    image / video token; image_mask alone: no video placeholders (a caller that knows of images
    only). GLM-4.5V writes video frames with the image token: those inside a video span (after
    more video start than end tokens) are the video's, whatever image_mask says."""
    vision = cfg.vision
    if cfg.family not in FRAMES_AS_IMAGES:
        image = input_ids == vision.image_token_id if image_mask is None else image_mask
        if video_mask is None:
            video_mask = input_ids == vision.video_token_id if image_mask is None else torch.zeros_like(image)
        return image, video_mask
    visual = input_ids == vision.image_token_id if image_mask is None else image_mask
    if video_mask is None:
        video = visual & in_video_span(input_ids, vision)
    else:
        visual, video = visual | video_mask, video_mask
    return visual & ~video, video


def in_video_span(input_ids: torch.Tensor, vision) -> torch.Tensor:
    """[B, T] True after more video start than end tokens in the row (GLM's processor's rule)."""
    if vision.video_start_token_id is None or vision.video_end_token_id is None:
        return torch.zeros_like(input_ids, dtype=torch.bool)
    starts = (input_ids == vision.video_start_token_id).cumsum(-1)
    return starts > (input_ids == vision.video_end_token_id).cumsum(-1)


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], cfg: ArchConfig,
                    attention_mask: Optional[torch.Tensor] = None,
                    image_mask: Optional[torch.Tensor] = None,
                    video_grid_thw: Optional[torch.Tensor] = None,
                    second_per_grid_ts: Optional[torch.Tensor] = None,
                    video_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[3, B, T] (temporal, height, width) positions, as transformers' get_rope_index of the family:
    text tokens count up on all three axes; an image's (or a video span's) tokens sit on its merged
    grid starting at the position after the text before it, and the text after it resumes at that
    start + max(h, w) / m, whatever its temporal extent. Pad tokens (mask 0) get 1.
    image_mask / video_mask [B, T]: the placeholders (default: `placeholders`)."""
    b, t = input_ids.shape
    out = torch.ones(3, b, t, dtype=torch.long, device=input_ids.device)
    image, video = placeholders(input_ids, cfg, image_mask, video_mask)
    kinds = (image.long() + 2 * video.long()).cpu()  # 0 text, 1 image, 2 video
    items = {1: iter([(grid, 1) for grid in grid_list(image_grid_thw)] if image_grid_thw is not None else []),
             2: iter(video_items(video_grid_thw, second_per_grid_ts, cfg))}
    m = cfg.vision.spatial_merge_size
    for row in range(b):
        keep = torch.ones(t, dtype=torch.bool) if attention_mask is None else attention_mask[row].bool().cpu()
        row_kinds = kinds[row][keep]
        pos, cols, i = 0, [], 0
        while i < len(row_kinds):
            kind = int(row_kinds[i])
            if kind == 0:
                n = run_length(row_kinds, i)
                cols.append(torch.arange(pos, pos + n).expand(3, -1))
                pos += n
            else:
                (gt, gh, gw), interval = next_item(items[kind], kind)
                tt = (torch.arange(gt) * interval).long()
                hh, ww = torch.arange(gh // m), torch.arange(gw // m)
                grid = torch.stack(torch.meshgrid(tt, hh, ww, indexing="ij")).reshape(3, -1) + pos
                n = grid.shape[1]
                if run_length(row_kinds, i) < n:
                    raise ValueError(f"a {'video' if kind == 2 else 'image'} of grid {(gt, gh, gw)} needs {n} "
                                     f"consecutive placeholders, row {row} has {run_length(row_kinds, i)}")
                cols.append(grid)
                pos += max(gh, gw) // m
            i += n
        out[:, row, keep.to(out.device)] = torch.cat(cols, dim=1).to(out.device)
    return out


def video_items(video_grid_thw: Optional[torch.Tensor], second_per_grid_ts: Optional[torch.Tensor],
                cfg: ArchConfig) -> list[tuple[tuple[int, int, int], int | torch.Tensor]]:
    """The (grid, temporal step) of each placeholder span of the videos, in order. Qwen3-VL / GLM-4.5V:
    one one-frame span per temporal patch. Qwen2.5-VL: one span per video, its temporal patches
    tokens_per_second * second_per_grid_t apart (float32, truncated, as transformers; 1 second per
    patch without second_per_grid_ts)."""
    if video_grid_thw is None:
        return []
    grids = grid_list(video_grid_thw)
    if cfg.family in FRAME_SPANS:
        return [((1, h, w), 1) for t, h, w in grids for _ in range(t)]
    seconds = [1] * len(grids) if second_per_grid_ts is None else second_per_grid_ts.float().cpu()
    return [(grid, cfg.vision.tokens_per_second * s) for grid, s in zip(grids, seconds)]


def next_item(items, kind: int):
    """The next (grid, temporal step) of `kind` (1 image, 2 video); a clear error past the last."""
    try:
        return next(items)
    except StopIteration:
        name = "video" if kind == 2 else "image"
        raise ValueError(f"more {name} placeholder spans in input_ids than {name} grids") from None


def run_length(kinds: torch.Tensor, i: int) -> int:
    """How many tokens from i on are of kinds[i]'s kind."""
    rest = kinds[i:] != kinds[i]
    return int(rest.int().argmax()) if bool(rest.any()) else len(kinds) - i
