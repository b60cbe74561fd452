"""INT4 W4A16: symmetric group quantization of weights along the input dim, nibble packing, GEMM.

A weight w [..., N, K] is cut into groups of `group` (32 or 128) consecutive input channels; each
group gets one fp32 scale `s = max|w| / 7` and integer codes `q = clamp(round(w / s), -7, 7)`
(round half to even, as torch.round). -8 is never used, so the grid is symmetric and `-q` is
always representable. A K that is not a multiple of `group` is zero-padded for the group statistics.

Packing (`pack_int4`), two codes per byte along K, offset binary:
    byte[..., j] = (q[..., 2j] + 8)  |  (q[..., 2j + 1] + 8) << 4
i.e. the even element sits in the LOW nibble, the odd element in the HIGH nibble, and a nibble holds
`q + 8` in [1, 15] (nibble 8 is zero). An odd K is padded with one zero code. This is not the int32
layout of compressed-tensors / GPTQ; it is the byte layout weight sync carries and checksums.

Like fp8.py, every function is bitwise identical on CPU and CUDA (tensor / tensor IEEE division,
round-half-even, exact integer packing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from miles.precision.fp8 import _absmax, _as_input, _pad

INT4_MAX = 7
GROUP_SIZES = (32, 128)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_group(group: int) -> None:
    # Any positive group works arithmetically; the recipes ship 32 and 128 and we keep it at that so a
    # typo (group=12) fails here instead of producing a format no engine expects.
    if group not in GROUP_SIZES:
        raise ValueError(f"int4 group must be one of {GROUP_SIZES}, got {group}")


def quantize_int4(w: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [..., N, K] float -> q: [..., N, K] int8 in [-7, 7], scale: [..., N, ceil(K/group)] float32."""
    _check_group(group)
    *lead, k = w.shape
    kg = _ceil_div(k, group)
    groups = _pad(_as_input(w), (0, kg * group - k)).reshape(*lead, kg, group)
    amax = _absmax(groups, -1)  # [..., N, kg], fp32
    scale = amax / torch.full_like(amax, float(INT4_MAX))
    # Zero (or underflowing) groups: scale 1 keeps q = 0 without 0/0 and dequantizes exactly to 0.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(torch.div(groups, scale[..., None])).clamp_(-INT4_MAX, INT4_MAX)
    q = q.reshape(*lead, kg * group)[..., :k].to(torch.int8).contiguous()
    return q, scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q: [..., K] int codes in [-8, 7] -> [..., ceil(K/2)] uint8 (even element in the low nibble)."""
    k = q.shape[-1]
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    if k % 2:
        u = F.pad(u, (0, 1), value=8)  # code 8 = value 0
    u = u.reshape(*u.shape[:-1], -1, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """packed: [..., ceil(K/2)] uint8 -> q: [..., K] int8 (exact inverse of pack_int4)."""
    if packed.shape[-1] != _ceil_div(k, 2):
        raise ValueError(f"packed last dim {packed.shape[-1]} does not hold K={k} codes")
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    q = codes.view(torch.int8) - 8  # codes are 0..15, so the uint8 -> int8 reinterpretation is exact
    return q[..., :k] if k == q.shape[-1] else q[..., :k].contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, group: int = 128, k: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed: [..., N, ceil(K/2)] uint8, scales: [..., N, ceil(K/group)] -> w: [..., N, K] in `dtype`.

    `k` defaults to 2 * packed.shape[-1] (pass it for an odd K). The product is formed in fp32 and
    rounded to `dtype` once, the same bits as fake_quant_int4 produces on the training side.
    """
    _check_group(group)
    k = 2 * packed.shape[-1] if k is None else k
    if scales.shape[-1] != _ceil_div(k, group):
        raise ValueError(f"scales last dim {scales.shape[-1]} != ceil(K={k} / group={group})")
    q = unpack_int4(packed, k)  # int8; the product below promotes it to fp32 on load (exact)
    if k % group == 0:  # broadcast the scales over a group view instead of materializing [..., N, K]
        return (q.reshape(*q.shape[:-1], k // group, group) * scales[..., None]).reshape(q.shape).to(dtype)
    return (q * scales.repeat_interleave(group, dim=-1)[..., :k]).to(dtype)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, group: int = 128,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A16 GEMM: x [..., K] @ dequant(packed [N, ceil(K/2)], scales [N, ceil(K/group)]).T -> [..., N].

    Dequantize-then-matmul in x.dtype: the activations stay in high precision (A16). On the training
    side F.linear(x, fake_quant_int4(w, group)) computes exactly this.
    """
    w = dequantize_int4(packed, scales, group, k=x.shape[-1], dtype=x.dtype)
    return F.linear(x, w, bias)
