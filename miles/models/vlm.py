"""Vision-language model: the family's decoder (CausalLM, unchanged) plus a vision tower whose
merged patch features replace the image placeholder tokens' embeddings, with mRoPE positions.
The family picks the tower (TOWERS): Qwen2.5-VL's, Qwen3-VL's (dense and MoE decoders) or
GLM-4.5V's. Qwen3-VL's DeepStack features (inner tower blocks' merged outputs) are added to the
image tokens' hidden states after the first decoder layers, inside this forward, so the engine and
the trainer call every VLM alike.

    logits = VisionLM(cfg)(input_ids, pixel_values=..., image_grid_thw=...)

A prompt holds, per image, `<vision_start> <image_pad> x n <vision_end>` with n = t * h * w / m^2
(what the family's processor writes); images appear in `image_grid_thw` order across the batch.
Without pixel_values the model is its text decoder (mRoPE with three equal positions is RoPE).
A sampled response may hold the image token too (a tiny random model's does); `image_mask` then
says which placeholders the images fill (the prompt's), the others are text.
"""

from __future__ import annotations

from typing import Optional

import torch

from miles.models.causal_lm import CausalLM
from miles.models.config import ArchConfig
from miles.models.vision import VisionTower
from miles.models.vision_glm4v import Glm4vVisionTower
from miles.models.vision_qwen3 import Qwen3VisionTower

# family -> its vision tower: (pixel_values, image_grid_thw) -> [image tokens, (1 + k) * hidden], each
# token's merged features and then its k DeepStack features (k = 0 but for Qwen3-VL).
TOWERS = {"qwen2_5_vl": VisionTower, "qwen3_vl": Qwen3VisionTower, "qwen3_vl_moe": Qwen3VisionTower,
          "glm4v_moe": Glm4vVisionTower}


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
        **kwargs,
    ) -> torch.Tensor:
        """Logits [B, T, V]. pixel_values / image_grid_thw: the processor's output for the batch's
        images; mrope_position_ids [3, B, T] default to `mrope_positions` (left padding honoured
        through attention_mask); image_mask [B, T]: the placeholders the images fill (default:
        every image token). Other arguments as CausalLM.forward."""
        embeds = self.embed_tokens(input_ids)
        deepstack = []
        if pixel_values is not None:
            features, *deepstack = self.visual(pixel_values, image_grid_thw).split(self.config.hidden_size, dim=-1)
            slots = input_ids == self.config.vision.image_token_id if image_mask is None else image_mask
            if int(slots.sum()) != features.shape[0]:
                raise ValueError(f"{int(slots.sum())} image tokens in input_ids but the images give "
                                 f"{features.shape[0]} features (grids {image_grid_thw.tolist()})")
            embeds = embeds.masked_scatter(slots[..., None], features.to(embeds.dtype))
            # Zero away from the image tokens: adding it leaves those hidden states bit for bit.
            deepstack = [torch.zeros_like(embeds).masked_scatter(slots[..., None], f.to(embeds.dtype))
                         for f in deepstack]
        if mrope_position_ids is None and kwargs.get("cache") is not None:
            # Tokens after an image sit at (prompt's last mRoPE position + 1 + step), which only the
            # caller that ran the prompt knows.
            raise ValueError("decoding with a cache needs mrope_position_ids (see mrope_positions)")
        if mrope_position_ids is None:
            mrope_position_ids = mrope_positions(input_ids, image_grid_thw, self.config, attention_mask, image_mask)
        return super().forward(input_ids, attention_mask, inputs_embeds=embeds,
                               mrope_position_ids=mrope_position_ids, layer_additions=deepstack, **kwargs)


def mrope_positions(input_ids: torch.Tensor, image_grid_thw: Optional[torch.Tensor], cfg: ArchConfig,
                    attention_mask: Optional[torch.Tensor] = None,
                    image_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[3, B, T] (temporal, height, width) positions: text tokens count up on all three axes; an
    image's tokens sit on its merged grid starting at the position after the text before it, and
    the text after it resumes at 1 + that start + max(h, w) / m. Pad tokens (mask 0) get 1.
    image_mask [B, T]: the image placeholders (default: every image token)."""
    vision = cfg.vision
    b, t = input_ids.shape
    out = torch.ones(3, b, t, dtype=torch.long, device=input_ids.device)
    grids = iter([] if image_grid_thw is None else [tuple(int(v) for v in g) for g in image_grid_thw.tolist()])
    if image_mask is None:
        image_mask = input_ids == vision.image_token_id
    for row in range(b):
        keep = torch.ones(t, dtype=torch.bool) if attention_mask is None else attention_mask[row].bool().cpu()
        ids = image_mask[row].cpu()[keep].tolist()
        pos, cols, i = 0, [], 0
        while i < len(ids):
            if not ids[i]:
                cols.append(torch.full((3, 1), pos))
                pos, i = pos + 1, i + 1
                continue
            gt, gh, gw = next(grids)
            m = vision.spatial_merge_size
            tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(gh // m), torch.arange(gw // m), indexing="ij")
            cols.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            i += gt * (gh // m) * (gw // m)
            pos += max(gh, gw) // m
        out[:, row, keep.to(out.device)] = torch.cat(cols, dim=1).to(out.device)
    return out
