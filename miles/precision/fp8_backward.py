"""The FP8 backward of a training linear (`precision.fp8_backward=fp8`), DeepSeek-V3's tiling.

    w_t = TransposedFP8Weight(q_w, w_scale)       # once per optimizer step (FP8WeightCache.transposed)
    grad_x = dgrad(g, w_t, out_dtype)              # g [M, N] -> [M, K]
    grad_w = wgrad(g, x, out_dtype)                # g [M, N], x [M, K] -> [N, K]

For y = x W^T, W [N, K] quantized in 128x128 blocks (the forward's codes and scales):
- dgrad: grad_x = Q(g) Q(W), g's tiles 1x128 along N (the contracted axis), W's blocks transposed
  (a block's scale is the same number either way, so W^T's codes and scales are the forward's);
- wgrad: grad_W = Q(g^T) Q(x^T)^T, both in 1x128 tiles along the tokens M (the contracted axis;
  DeepSeek-V3's 128x1 tiles of g and x).
x is what the forward multiplied: the bf16 activations (w8a16) or the dequantized 1x128 activations
(w8a8). The forward is untouched, so the log-probs (and the first step's ppo_kl = 0) are not.

Kernels: on CUDA, for a bf16 compute dtype, torch's blockwise `scaled_mm` (cuBLASLt's 1x128 x
128x128 and 1x128 x 1x128 kernels, fp32 accumulation, bf16 out) where a one-off probe per device
finds them right against the emulated product; elsewhere, or if the probe fails (`probe_report`
says why, and a warning once), the emulated product:
dequantize, then a matmul in the compute dtype (the same values, another summation order). The
activation tiles come from the forward's quantizer (`quantize_act_for_scaled_mm`; on CUDA the fused
Triton kernel, reading g^T and x^T in place).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from miles.precision.fp8 import BLOCK, dequantize_fp8_act, dequantize_fp8_weight, quantize_fp8_act
from miles.precision.fp8_gemm import (PreparedFP8Weight, fp8_linear_prepared, prepare_scaled_mm_weight,
                                      quantize_act_for_scaled_mm)

_PROBE_TOL = 2e-2  # relative to the output's max, as the forward's probe (bf16 output rounding ~4e-3)
_PROBES: dict[str, tuple[bool, str]] = {}  # device -> (kernels usable, why)
_WGRAD_LAYOUTS = ("nk", "kn_rows", "kn_cols")  # wgrad's scale_b candidates, tried in order


class TransposedFP8Weight:
    """W^T's codes and 128x128 block scales: the dgrad operand. `mm` is laid out for scaled_mm when the
    kernels run on this device, else None (the emulated product reads `q`, `scale`)."""

    def __init__(self, q_w: torch.Tensor, w_scale: torch.Tensor):
        self.q, self.scale = q_w.t().contiguous(), w_scale.t().contiguous()  # [K, N], [kb, nb]
        self.mm: PreparedFP8Weight | None = (prepare_scaled_mm_weight(self.q, self.scale)
                                             if kernels_usable(q_w.device) else None)


def dgrad(g: torch.Tensor, w_t: TransposedFP8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """g [M, N] -> grad_x [M, K] = Q(g) @ Q(W) (g in 1x128 tiles along N)."""
    if w_t.mm is not None and out_dtype == torch.bfloat16:
        return fp8_linear_prepared(g, w_t.mm, out_dtype)
    gq, gs = quantize_fp8_act(g)
    return F.linear(dequantize_fp8_act(gq, gs, out_dtype), dequantize_fp8_weight(w_t.q, w_t.scale, out_dtype))


def wgrad(g: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """g [M, N], x [M, K] -> grad_W [N, K] = Q(g^T) @ Q(x^T)^T (both in 1x128 tiles along M)."""
    if out_dtype == torch.bfloat16 and kernels_usable(g.device):
        return _wgrad_scaled_mm(g, x, out_dtype, _PROBES[str(g.device)][1])
    gq, gs = quantize_fp8_act(g.t())
    xq, xs = quantize_fp8_act(x.t())
    return F.linear(dequantize_fp8_act(gq, gs, out_dtype), dequantize_fp8_act(xq, xs, out_dtype))


def _wgrad_scaled_mm(g: torch.Tensor, x: torch.Tensor, out_dtype: torch.dtype, layout: str) -> torch.Tensor:
    n, k = g.shape[1], x.shape[1]
    mp = -(-g.shape[0] // BLOCK) * BLOCK  # the contracted axis, zero-padded to whole tiles
    gq, gs = quantize_act_for_scaled_mm(g.t(), mp)  # [Np, mp], scales [Np, mp/128] strides (1, Np)
    xq, xs = quantize_act_for_scaled_mm(x.t(), mp)  # [Kp, mp], scales [Kp, mp/128] strides (1, Kp)
    from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

    # B = x^T's codes transposed [mp, Kp] with 1x128 tiles along mp. torch 2.11 on an H100 takes their
    # scales as [Kp, mp/128] ("nk"); the probe tries the other layouts where it does not (_WGRAD_LAYOUTS)
    scale_b = {"kn_rows": lambda: xs.t(), "kn_cols": lambda: xs.contiguous().t(), "nk": lambda: xs}[layout]()
    out = scaled_mm(gq, xq.t(), gs, ScalingType.BlockWise1x128, scale_b, ScalingType.BlockWise1x128,
                    swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=out_dtype)
    return out[:n, :k]


def kernels_usable(device: torch.device) -> bool:
    """Whether the scaled_mm backward runs on `device` (probed once per device; never on the CPU)."""
    if device.type != "cuda":
        return False
    key = str(device)
    if key not in _PROBES:
        _PROBES[key] = _probe(device)
        if not _PROBES[key][0]:  # once per device: the emulated products are slower than bf16's backward
            warnings.warn(f"precision.fp8_backward=fp8: the scaled_mm kernels failed their probe on {key} "
                          f"({_PROBES[key][1]}); the backward runs the emulated products, slower than "
                          "the bf16 backward: set precision.fp8_backward=bf16", stacklevel=2)
    return _PROBES[key][0]


def probe_report(device: torch.device) -> str:
    """What the backward multiplies with on `device`, and why (for logs and benchmarks)."""
    if not kernels_usable(device):
        why = _PROBES.get(str(device), (False, "not a CUDA device"))[1]
        return f"emulated (dequantize, then a matmul in the compute dtype): {why}"
    return f"scaled_mm blockwise (wgrad scale layout {_PROBES[str(device)][1]})"


def _probe(device: torch.device) -> tuple[bool, str]:
    """Run dgrad and wgrad's kernels once on awkward shapes with varied scales against the emulated
    products; (True, the wgrad scale layout that passed) or (False, why not)."""
    try:
        from torch.nn.functional import ScalingType  # noqa: F401  (the v2 API the kernels need)
    except ImportError:
        return False, "this torch has no torch.nn.functional.scaled_mm"
    from miles.precision.fp8 import quantize_fp8_weight

    gen = torch.Generator().manual_seed(0)
    m, n, k = 200, 320, 384
    g = (torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-4, 5, (m, 1), generator=gen).float()))
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 5, (1, k), generator=gen).float())
    q_w, w_s = quantize_fp8_weight(torch.randn(n, k, generator=gen))
    g16, x16 = g.to(device, torch.bfloat16), x.to(device, torch.bfloat16)
    ref_w = _emulated_wgrad(g16.cpu(), x16.cpu())
    ref_x = F.linear(_deq_act(g16.cpu()), dequantize_fp8_weight(q_w.t().contiguous(), w_s.t().contiguous()))
    try:
        w_t = prepare_scaled_mm_weight(q_w.t().contiguous().to(device), w_s.t().contiguous().to(device))
        err = _rel_err(fp8_linear_prepared(g16, w_t, torch.bfloat16), ref_x)
        if not err <= _PROBE_TOL:
            return False, f"dgrad: wrong result, max error {err:.3g} of the output's max"
        tried = []
        for layout in _WGRAD_LAYOUTS:
            try:
                err = _rel_err(_wgrad_scaled_mm(g16, x16, torch.bfloat16, layout), ref_w)
            except (RuntimeError, ValueError) as e:  # torch checks the scales' shape and strides
                tried.append(f"{layout}: {str(e).splitlines()[0][:120]}")
                continue
            if err <= _PROBE_TOL:
                return True, layout
            tried.append(f"{layout}: max error {err:.3g}")
        return False, "wgrad: " + "; ".join(tried)
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"; the report says why
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def _deq_act(t: torch.Tensor) -> torch.Tensor:
    return dequantize_fp8_act(*quantize_fp8_act(t))


def _emulated_wgrad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _deq_act(g.t()) @ _deq_act(x.t()).t()


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float().cpu() - ref).abs().max() / ref.abs().max()).item()
