"""Rotary position embedding: frequencies (plain or scaled), cos / sin tables, application.

Layout is HF's "rotate half": within the rotated width, dimension j is paired with j + dim/2 and
both share frequency j. With partial rotary (GLM-4.5, Qwen3-Next) only the first `rotary_dim`
dims of each head rotate; the rest pass through. Angles, cos and sin are computed in float32 and
cast to the dtype of q / k only when applied. There is no cached buffer, so `model.to(dtype)` or
meta-device construction cannot degrade or lose a table.
"""

from __future__ import annotations

import math

import torch

from miles.models import fused
from miles.models.config import RopeScalingConfig


def inv_freq(dim: int, theta: float, scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] float32, attention factor multiplying cos and sin)."""
    base = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if scaling is None:
        return base, 1.0
    if scaling.type == "yarn":
        return _yarn_inv_freq(base, dim, theta, scaling)
    if scaling.type == "llama3":
        return _llama3_inv_freq(base, scaling), 1.0
    raise ValueError(f"rope_scaling.type {scaling.type!r} is not implemented")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale_factor(scaling: RopeScalingConfig | None) -> float:
    """Factor on 1/sqrt(head_dim) in attention: DeepSeek's YaRN corrects the softmax temperature by
    mscale(factor, mscale_all_dim)^2 (the cos / sin attention factor then cancels to ~1)."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def _yarn_inv_freq(base: torch.Tensor, dim: int, theta: float,
                   scaling: RopeScalingConfig) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers' `_compute_yarn_parameters`: frequencies that turn
    fewer than beta_slow times over the original context are interpolated (divided by factor),
    those turning more than beta_fast times are kept, a linear ramp over dims blends in between."""
    factor = scaling.factor
    if scaling.attention_factor:
        attention = scaling.attention_factor
    elif scaling.mscale and scaling.mscale_all_dim:
        attention = yarn_mscale(factor, scaling.mscale) / yarn_mscale(factor, scaling.mscale_all_dim)
    else:
        attention = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # the dim whose wavelength completes `rotations` turns over the original context
        return dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (frequency / factor)
    wavelength_factor = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    # 1 / (factor * x) rather than base / factor: the same rounding as transformers, bit for bit
    freq = 1.0 / (factor * wavelength_factor) * (1 - keep) + base * keep
    return freq, float(attention)


def _llama3_inv_freq(base: torch.Tensor, scaling: RopeScalingConfig) -> torch.Tensor:
    """Llama 3.1 / Llama 4 scaling (transformers' `_compute_llama3_parameters`): wavelengths shorter
    than original_len / high_freq_factor are kept, longer than original_len / low_freq_factor are
    divided by factor, and those in between blend smoothly (no attention factor)."""
    old_len, lo, hi = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / base
    freq = torch.where(wavelen > old_len / lo, base / scaling.factor, base)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * freq / scaling.factor + smooth * freq
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, smoothed, freq)


def rope_cos_sin(position_ids: torch.Tensor, dim: int, theta: float,
                 scaling: RopeScalingConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for the given positions, float32. position_ids: [B, T] (absolute, so left padding
    and decode steps need no special casing). Returns (cos, sin), each [B, T, dim]."""
    freq, factor = _device_inv_freq(dim, theta, repr(scaling), position_ids.device, scaling)
    angles = position_ids[..., None].float() * freq  # [B, T, dim/2]
    angles = torch.cat((angles, angles), dim=-1)  # both halves of a pair share a frequency
    return angles.cos() * factor, angles.sin() * factor


def mrope_cos_sin(position_ids: torch.Tensor, dim: int, theta: float, sections: list[int],
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE (Qwen2-VL / Qwen2.5-VL / GLM-4.5V): position_ids [3, B, T] hold temporal,
    height and width positions; frequency j of the dim/2 rotates by the axis whose section
    (consecutive blocks of `sections`, cycling t, h, w) contains j. `interleaved` (Qwen3-VL): j
    rotates by height when j % 3 == 1 and j < 3 * sections[1], by width when j % 3 == 2 and
    j < 3 * sections[2], else by time (transformers' rule, kept exactly). Text tokens have three
    equal positions, so for them this is plain RoPE. Returns (cos, sin), each [B, T, dim], float32."""
    freq, _ = _device_inv_freq(dim, theta, "None", position_ids.device, None)
    angles = position_ids[..., None].float() * freq  # [3, B, T, dim/2]
    if interleaved:
        picked = angles[0].clone()
        for axis in (1, 2):
            every_third = slice(axis, 3 * sections[axis], 3)
            picked[..., every_third] = angles[axis][..., every_third]
        angles = picked
    else:
        picked = [part[i % 3] for i, part in enumerate(angles.split(list(sections), dim=-1))]
        angles = torch.cat(picked, dim=-1)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


_INV_FREQ: dict = {}


def _device_inv_freq(dim: int, theta: float, scaling_key: str, device: torch.device,
                     scaling: RopeScalingConfig | None) -> tuple[torch.Tensor, float]:
    """inv_freq on `device`, computed once per (dim, theta, scaling, device): no host-to-device copy
    per forward, which CUDA-graph capture forbids and every decode step would pay for."""
    key = (dim, theta, scaling_key, str(device))
    if key not in _INV_FREQ:
        freq, factor = inv_freq(dim, theta, scaling)
        _INV_FREQ[key] = freq.to(device), factor
    return _INV_FREQ[key]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x: [B, H, T, D] by cos / sin: [B, T, rotary_dim].
    Keeps x's dtype; dims past rotary_dim pass through unchanged."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return fused.ops["rotate"](x, cos, sin)
    return torch.cat((fused.ops["rotate"](x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
