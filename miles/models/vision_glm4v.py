"""The GLM-4.5V vision tower (family glm4v_moe), after transformers' modeling_glm4v_moe.py:

  patch embedding (HF's Conv3d, with a bias, as a Linear over the flattened patch; vision.py)
  -> RMSNorm (post_conv_layernorm)
  + a learned square grid of position embeddings, resampled bicubically to each image's patch grid
    (F.grid_sample at the patch centres, border padding, float32: transformers' exact call)
  -> RMSNorm ViT blocks: bias-free 2-D rotary attention over each frame of each image, a bias-free
     SwiGLU MLP of width out_hidden_size
  -> RMSNorm (post_layernorm) -> `downsample`: each m x m block of patches to one decoder-width
     token (HF's stride = kernel Conv2d, again a Linear over the flattened block)
  -> the merger: Linear, LayerNorm, GELU, then a SwiGLU of width intermediate_size.

RMSNorm epsilon: `norm_eps` (the checkpoint's rms_norm_eps). Parameter names equal the
checkpoint's `model.visual.*` minus "model.".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import VisionConfig
from miles.models.layers import RMSNorm, SwiGLUMLP, embedding
from miles.models.vision import PatchEmbed, VisionAttention, block_major, frame_mask, grid_list, vision_rope


class GlmVisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = VisionAttention(cfg, bias=False)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.out_hidden_size)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class GlmPatchMerger(SwiGLUMLP):
    """gate / up / down of a SwiGLU (out_hidden_size -> intermediate_size -> out_hidden_size)
    after a projection, a LayerNorm (torch's default epsilon, as HF) and a GELU."""

    def __init__(self, cfg: VisionConfig):
        super().__init__(cfg.out_hidden_size, cfg.intermediate_size)
        self.proj = nn.Linear(cfg.out_hidden_size, cfg.out_hidden_size, bias=False)
        self.post_projection_norm = nn.LayerNorm(cfg.out_hidden_size)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        return super().forward(F.gelu(self.post_projection_norm(self.proj(x))))


class GlmPositionEmbedding(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.position_embedding = embedding(cfg.num_position_embeddings, cfg.hidden_size)

    def forward(self, grids: list[tuple[int, int, int]], m: int) -> torch.Tensor:
        """The [side * side, E] grid sampled bicubically at every patch centre of every image
        (normalised coordinates (i + 0.5) / size * 2 - 1), in the processor's patch order,
        repeated for each of an image's t frames -> [N, E] in the table's dtype."""
        table = self.position_embedding.weight
        side = int(round(table.shape[0] ** 0.5))
        square = table.float().view(side, side, -1).permute(2, 0, 1)[None]  # [1, E, side, side]
        rows = []
        for t, h, w in grids:
            ys = (torch.arange(h, device=table.device) + 0.5) / h * 2 - 1
            xs = (torch.arange(w, device=table.device) + 0.5) / w * 2 - 1
            where = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1)[None]  # [1, h, w, (x, y)]
            grid = F.grid_sample(square, where, mode="bicubic", align_corners=False, padding_mode="border")[0]
            rows.append(block_major(grid, m).repeat(t, 1))
        return torch.cat(rows).to(table.dtype)


class Glm4vVisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        m2 = cfg.spatial_merge_size ** 2
        self.patch_embed = PatchEmbed(cfg, bias=True)
        self.post_conv_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.embeddings = GlmPositionEmbedding(cfg)
        self.blocks = nn.ModuleList(GlmVisionBlock(cfg) for _ in range(cfg.depth))
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.downsample = nn.Linear(cfg.hidden_size * m2, cfg.out_hidden_size)
        self.merger = GlmPatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C * tp * p * p], grid_thw [images, 3] -> merged tokens
        [N / m^2, out_hidden_size], in the images' (and the placeholders') order."""
        cfg = self.cfg
        m = cfg.spatial_merge_size
        grids = grid_list(grid_thw)
        x = self.post_conv_layernorm(self.patch_embed(pixel_values))
        x = x + self.embeddings(grids, m).to(x.dtype)
        cos, sin = vision_rope(grids, cfg, x.device)
        mask = frame_mask(grids, x.device)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        x = self.post_layernorm(x)
        # The m x m patches of a block are consecutive; the Conv2d kernel is [out, C, m, m].
        blocks = x.view(-1, m, m, cfg.hidden_size).permute(0, 3, 1, 2).reshape(-1, cfg.hidden_size * m * m)
        return self.merger(self.downsample(blocks))
