"""The Qwen2.5-VL vision tower: patch embedding, 2-D rotary ViT blocks with windowed / full
attention, and the patch merger that turns each m x m block of patches into one decoder token;
and the parts the Qwen3-VL and GLM-4.5V towers share with it (vision_qwen3.py, vision_glm4v.py).

Input is what transformers' Qwen2VLImageProcessor gives: `pixel_values` [N, C * tp * p * p], one
row per patch, patches of an image ordered block by block (the m x m patches a merger token
takes are consecutive), and `grid_thw` [images, 3] each image's (temporal, height, width) patch
grid. Images of any size share one call: attention never crosses an image (nor a window).

The patch embedding is HF's stride = kernel Conv3d, which on exactly one patch is a matmul: a
Linear over the flattened patch, bias-free in Qwen2.5-VL (the family converts the [E, C, tp, p, p]
kernel).
Parameter names equal the checkpoint's `visual.*` names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from miles.models.config import VisionConfig
from miles.models.layers import RMSNorm
from miles.models.rope import apply_rope


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, bias: bool = False):
        super().__init__()
        patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.proj = nn.Linear(patch, cfg.hidden_size, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, bias: bool = True):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden]; cos / sin: [N, head_dim]; mask: [N, N] True where attention is allowed."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # 3 x [H, N, D]
        # HF rotates the ViT's q / k in float32 whatever the weights' dtype.
        q = apply_rope(q.float()[None], cos[None], sin[None])[0].to(v.dtype)
        k = apply_rope(k.float()[None], cos[None], sin[None])[0].to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with biases (the ViT's; the decoder's SwiGLU has none)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, 1e-6)  # eps fixed at 1e-6 in the published models
        self.norm2 = RMSNorm(cfg.hidden_size, 1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, mask):
        x = x + self.attn(self.norm1(x), cos, sin, mask)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """RMSNorm each patch, concatenate the m x m patches of a block, then a GELU MLP to the decoder width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, cfg.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C * tp * p * p], grid_thw [images, 3] -> merged tokens
        [N / m^2, out_hidden_size], in the images' (and the placeholders') order."""
        cfg = self.cfg
        unit = cfg.spatial_merge_size ** 2
        grids = grid_list(grid_thw)
        order, window_ids = window_order(grids, cfg)  # merger blocks regrouped window by window
        patch_order = (order[:, None] * unit + torch.arange(unit)).flatten().to(pixel_values.device)
        x = self.patch_embed(pixel_values)[patch_order]
        cos, sin = vision_rope(grids, cfg, x.device)
        cos, sin = cos[patch_order], sin[patch_order]
        image_ids = torch.cat([torch.full((t * h * w,), i) for i, (t, h, w) in enumerate(grids)])
        # Full attention: within one frame of one image; windowed: within one window as well.
        frame_ids = torch.cat([torch.arange(t).repeat_interleave(h * w) for t, h, w in grids])
        full = (image_ids * (1 + max(t for t, _, _ in grids)) + frame_ids)[patch_order.cpu()].to(x.device)
        window = window_ids.repeat_interleave(unit).to(x.device)
        full_mask = full[:, None] == full[None, :]
        window_mask = window[:, None] == window[None, :]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full_mask if i in cfg.fullatt_block_indexes else window_mask)
        return self.merger(x)[torch.argsort(order.to(x.device))]


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """image_grid_thw [images, 3] as (t, h, w) ints."""
    return [tuple(int(v) for v in g) for g in grid_thw.tolist()]


def frame_mask(grids: list[tuple[int, int, int]], device) -> torch.Tensor:
    """[N, N] True where two patches lie in the same frame of the same image: the full attention
    of the Qwen3-VL and GLM-4.5V towers (transformers' per-frame cu_seqlens)."""
    frames = torch.arange(sum(t for t, _, _ in grids), device=device)
    frame_of_patch = frames.repeat_interleave(torch.tensor([h * w for t, h, w in grids for _ in range(t)],
                                                           device=device))
    return frame_of_patch[:, None] == frame_of_patch[None, :]


def block_major(grid: torch.Tensor, m: int) -> torch.Tensor:
    """[E, h, w] per-patch values in raster order -> [h * w, E] in the processor's patch order: the
    m x m patches of one merger block consecutive, blocks row by row."""
    e, h, w = grid.shape
    return grid.reshape(e, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, e)


def vision_rope(grids: list[tuple[int, int, int]], cfg: VisionConfig, device) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D RoPE of every patch (block-major order): the first half of the rotary frequencies turn
    with the patch's row, the second half with its column. Returns (cos, sin), each [N, head_dim]."""
    half = cfg.head_dim // 2
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
    m = cfg.spatial_merge_size
    rows = []
    for t, h, w in grids:
        hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        block = (h // m, m, w // m, m)  # patch (row, col) in merger-block-major order
        hw = torch.stack([p.reshape(block).transpose(1, 2).flatten() for p in (hh, ww)], dim=-1)
        rows.append(hw.repeat(t, 1))
    pos = torch.cat(rows)  # [N, 2]
    angles = (pos[..., None].float() * inv).flatten(1)  # [N, half]: row angles, then column angles
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def window_order(grids: list[tuple[int, int, int]], cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Merger blocks grouped into windows of window_size pixels (Qwen2.5-VL's windowed attention):
    (order [blocks], the block indices window by window; window_ids [blocks], each position's window).
    Windows tile every frame from its top-left corner; edge windows are smaller."""
    side = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # window side in merger blocks
    order, window_ids, offset, window = [], [], 0, 0
    for t, h, w in grids:
        bh, bw = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        idx = torch.arange(t * bh * bw).reshape(t, bh, bw) + offset
        for frame in range(t):
            for r in range(0, bh, side):
                for c in range(0, bw, side):
                    cell = idx[frame, r:r + side, c:c + side].flatten()
                    order.append(cell)
                    window_ids.append(torch.full_like(cell, window))
                    window += 1
        offset += t * bh * bw
    return torch.cat(order), torch.cat(window_ids)
