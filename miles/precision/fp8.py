"""FP8 (e4m3) blockwise quantization, the DeepSeek-V3 / SGLang layout.

Weights are quantized in 128x128 blocks, activations in 1x128 tiles along the last (input) dim, each
block with one fp32 scale `s = amax / 448` so that `w ~= q * s` (`s` is what DeepSeek-V3 checkpoints
call `weight_scale_inv`). Shapes whose dims are not multiples of 128 are zero-padded for the block
statistics only (zeros never change an amax); `q` keeps the input's shape and the scale grid is
`ceil(dim / 128)`.

Everything here is a pure tensor function that gives bitwise identical results on CPU and CUDA:
all divisions are tensor / tensor (IEEE-rounded on both; CUDA turns a division by a Python scalar into
a multiplication by its reciprocal, which rounds differently), the amax is exact, and the fp8 cast
is round-to-nearest-even after an explicit clamp to +-448 (so no value ever reaches the NaN code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad(t: torch.Tensor, pads: tuple[int, ...]) -> torch.Tensor:
    """F.pad that skips the copy when nothing is padded (F.pad always copies)."""
    return F.pad(t, pads) if any(pads) else t


def _as_input(t: torch.Tensor) -> torch.Tensor:
    """bf16 / fp16 / fp32 are read as they are (exact in fp32); anything else is converted to fp32 first,
    so the arithmetic below is always fp32."""
    t = t.detach()
    return t if t.dtype in (torch.bfloat16, torch.float16, torch.float32) else t.to(torch.float32)


def _absmax(t: torch.Tensor, dim) -> torch.Tensor:
    """max |t| over `dim` as fp32, in one reduction pass (the inf-norm fuses the abs). Exact: the max of
    bf16 / fp16 / fp32 values is one of them, so reading the input in its own dtype loses nothing."""
    return torch.linalg.vector_norm(t, ord=float("inf"), dim=dim).to(torch.float32)


def _safe_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """amax / qmax with an IEEE division; all-zero (or underflowing) blocks get scale 1.0.

    Scale 1.0 for a zero block keeps `q = 0` without a 0/0 and keeps dequantization exact (0 * 1);
    a tiny amax whose scale underflows to 0 would otherwise divide by zero.
    """
    scale = amax / torch.full_like(amax, qmax)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8_weight(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise e4m3 quantization of a weight.

    w: [..., N, K] (any float dtype; leading dims, e.g. stacked MoE experts [E, N, K], are batched)
    -> q: [..., N, K] float8_e4m3fn, scale: [..., ceil(N/block), ceil(K/block)] float32, w ~= q * scale.
    """
    if w.dim() < 2:
        raise ValueError(f"quantize_fp8_weight needs a [..., N, K] tensor, got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    # No fp32 copy of w: the amax is exact in w's dtype and the division promotes each element to fp32
    # on load (the same bits as converting first, two fewer passes over the weight).
    blocks = _pad(_as_input(w), (0, kb * block - k, 0, nb * block - n)).reshape(*lead, nb, block, kb, block)
    scale = _safe_scale(_absmax(blocks, (-3, -1)), FP8_MAX)  # [..., nb, kb]
    q = torch.div(blocks, scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].to(FP8_DTYPE).contiguous()
    return q, scale


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """[..., ceil(N/b), ceil(K/b)] block scales -> the per-element scale [..., N, K]."""
    return scale.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]


def dequantize_fp8_weight(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                          block: int = BLOCK) -> torch.Tensor:
    """q: [..., N, K] fp8, scale: [..., ceil(N/b), ceil(K/b)] fp32 -> [..., N, K] in `dtype`.

    The product is taken in fp32 and rounded to `dtype` once, so every caller (the trainer's fake
    quantization, the engine's rebuilt weights, the emulated GEMM) gets the same bits.
    """
    *lead, n, k = q.shape
    q32 = q.to(torch.float32)
    if n % block == 0 and k % block == 0:  # broadcast over a block view: no [N, K] scale tensor
        nb, kb = n // block, k // block
        return (q32.reshape(*lead, nb, block, kb, block) * scale[..., :, None, :, None]).reshape(q.shape).to(dtype)
    return (q32 * expand_block_scale(scale, n, k, block)).to(dtype)


def quantize_fp8_act(x: torch.Tensor, tile: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token 1 x `tile` quantization along the last dim (DeepSeek-V3 `act_quant`).

    x: [..., K] -> q: [..., K] float8_e4m3fn, scale: [..., ceil(K/tile)] float32.
    """
    *lead, k = x.shape
    kb = _ceil_div(k, tile)
    tiles = _pad(_as_input(x), (0, kb * tile - k)).reshape(*lead, kb, tile)
    scale = _safe_scale(_absmax(tiles, -1), FP8_MAX)  # [..., kb]
    q = torch.div(tiles, scale[..., None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, kb * tile)[..., :k].to(FP8_DTYPE).contiguous()
    return q, scale


def dequantize_fp8_act(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                       tile: int = BLOCK) -> torch.Tensor:
    """q: [..., K] fp8, scale: [..., ceil(K/tile)] fp32 -> [..., K] in `dtype` (fp32 product, one rounding)."""
    *lead, k = q.shape
    q32 = q.to(torch.float32)
    if k % tile == 0:
        return (q32.reshape(*lead, k // tile, tile) * scale[..., None]).reshape(q.shape).to(dtype)
    return (q32 * scale.repeat_interleave(tile, dim=-1)[..., :k]).to(dtype)
