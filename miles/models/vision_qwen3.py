"""The Qwen3-VL vision tower (families qwen3_vl and qwen3_vl_moe), after transformers'
modeling_qwen3_vl.py:

  patch embedding (HF's Conv3d, with a bias, as a Linear over the flattened patch; vision.py)
  + a learned square grid of position embeddings, resampled bilinearly (corners aligned) to each
    image's patch grid
  -> LayerNorm ViT blocks: 2-D rotary attention over each frame of each image, GELU (tanh) MLP
  -> the patch merger: LayerNorm each patch, concatenate the m x m patches of a block, GELU MLP to
     the decoder width.

DeepStack: after each block listed in `deepstack_visual_indexes`, a merger of its own (LayerNorm
after the concatenation) turns that block's output into decoder-width features too; the k-th of
them is added to the image tokens' hidden states after decoder layer k (miles.models.vlm). The
tower returns them beside the merged tokens in one tensor, so that every tower's output is one
tensor of its image tokens (what the engine and the trainer carry per prompt).
Parameter names equal the checkpoint's `model.visual.*` minus "model.".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import VisionConfig
from miles.models.layers import embedding
from miles.models.vision import PatchEmbed, VisionAttention, block_major, frame_mask, grid_list, vision_rope

_EPS = 1e-6  # the LayerNorms' epsilon, fixed in transformers' Qwen3-VL


class Qwen3VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))  # hidden_act gelu_pytorch_tanh


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_EPS)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_EPS)
        self.attn = VisionAttention(cfg)
        self.mlp = Qwen3VisionMLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """m x m patches -> one decoder-width token. The main merger normalizes each patch before
    concatenating them; the DeepStack mergers (`after_concat`) normalize the concatenation."""

    def __init__(self, cfg: VisionConfig, after_concat: bool = False):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.after_concat = after_concat
        self.norm = nn.LayerNorm(self.merged if after_concat else cfg.hidden_size, eps=_EPS)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged)) if self.after_concat else self.norm(x).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.pos_embed = embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = Qwen3PatchMerger(cfg)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(cfg, after_concat=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C * tp * p * p], grid_thw [images, 3] -> [N / m^2, (1 + k) * out_hidden_size]:
        per image token (in the images' and the placeholders' order) its merged features, then the
        k DeepStack features, one per listed block in block order."""
        cfg = self.cfg
        grids = grid_list(grid_thw)
        x = self.patch_embed(pixel_values)
        x = x + learned_positions(self.pos_embed.weight, grids, cfg.spatial_merge_size).to(x.dtype)
        cos, sin = vision_rope(grids, cfg, x.device)
        mask = frame_mask(grids, x.device)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mask)
            if i in cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[cfg.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)


def learned_positions(table: torch.Tensor, grids: list[tuple[int, int, int]], m: int) -> torch.Tensor:
    """The [side * side, E] position grid resampled to every image's h x w patch grid (bilinear,
    corners aligned, in float32 as transformers does), in the processor's patch order, repeated
    for each of an image's t frames -> [N, E] float32."""
    side = int(round(table.shape[0] ** 0.5))
    square = table.float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, E, side, side]
    rows = []
    for t, h, w in grids:
        grid = F.interpolate(square, size=(h, w), mode="bilinear", align_corners=True)[0]
        rows.append(block_major(grid, m).repeat(t, 1))
    return torch.cat(rows)
