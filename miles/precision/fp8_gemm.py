"""FP8 blockwise GEMM `y = x @ W.T` with W in 128x128 blocks and x quantized on the fly in 1x128 tiles.

Backends (`fp8_linear(..., backend=...)`):
- "emulated": any device. Exactly dequantize-then-matmul (F.linear on the dequantized operands) in
  out_dtype (default x.dtype; pass torch.float32 for an fp32 reference). This is what the training
  forward computes through fake quantization, bit for bit.
- "scaled_mm": torch._scaled_mm (or its v2 form torch.nn.functional.scaled_mm) with DeepSeek-style
  scaling (A: BlockWise1x128, B: BlockWise128x128), which torch runs through cuBLASLt >= 12.9 on SM90
  (Hopper) only; on Blackwell this torch refuses it and "auto" falls back.
- "deep_gemm": DeepGEMM's FP8 NT GEMM when the package imports (bf16 output).
- "triton": the project's batch-invariant Triton GEMM (miles/precision/fp8_triton_gemm.py): a row's
  bits do not depend on the row count, so a decode step and the training forward agree. True
  on-policy mode runs it on CUDA whatever the backend (`gemm_quantized`).
- "auto": the first of deep_gemm, scaled_mm, emulated that passes a one-off numerical probe on the
  device; `resolve_fp8_backend` says which, `fp8_backend_report` says why the others were skipped.

torch's layout rules for the blockwise scales differ between versions (the 128x128 scale of B was
first required contiguous, later with its K-block stride rounded up to a multiple of 4, and the v2
API `torch.nn.functional.scaled_mm` takes the padded layout explicitly). Rather than pin a version,
the probe tries each known layout on a problem whose blocks differ in magnitude by up to 2^8 and keeps
the first whose result matches the emulated GEMM: a transposed or misread scale fails it loudly.
Seen on an H200 with torch 2.11+cu130 (docs/benchmarks.md): v1 refused the padded scale, v1 *accepted*
the contiguous one and returned a result off by 48% of the output's max, v2 was right.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from miles.precision import fp8_triton, fp8_triton_gemm, invariance
from miles.precision.fp8 import BLOCK, FP8_DTYPE, _pad, dequantize_fp8_act, dequantize_fp8_weight, quantize_fp8_act

BACKENDS = ("emulated", "scaled_mm", "deep_gemm", "triton")
_AUTO_ORDER = ("deep_gemm", "scaled_mm", "emulated")
_SCALED_MM_LAYOUTS = ("v1_padded", "v1_contiguous", "v2")
_M_ALIGN = 16  # cuBLASLt refused M=33 with 1x128 scales (ld = M) on an H200, took 200; pad rows to 16
_PROBE_TOL = 2e-2  # bf16 output rounding is ~4e-3; a misread scale is off by O(1)
_PROBES: dict[tuple[str, str], tuple[bool, str]] = {}
_LAYOUTS: dict[str, str] = {}  # device -> the scaled_mm scale layout that passed the probe


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class PreparedFP8Weight(NamedTuple):
    """A weight laid out for torch._scaled_mm: q [Np, Kp] fp8 row-major (N, K zero-padded to
    multiples of 128), scale_b as the chosen layout wants it, the true n and k, and the layout name."""

    q: torch.Tensor
    scale_b: torch.Tensor
    n: int
    k: int
    layout: str


def prepare_scaled_mm_weight(q_w: torch.Tensor, w_scale: torch.Tensor, layout: str | None = None) -> PreparedFP8Weight:
    """q_w [N, K] fp8, w_scale [ceil(N/128), ceil(K/128)] -> PreparedFP8Weight (done once per weight
    by an engine; fp8_linear does it per call). `layout` defaults to the probed one for q_w's device."""
    layout = layout or _scaled_mm_layout(q_w.device)
    n, k = q_w.shape
    nb, kb = w_scale.shape
    # Pad through a uint8 view: fp8 zero is byte 0 and padding ops are not implemented for fp8 dtypes.
    q = _pad(q_w.view(torch.uint8), (0, kb * BLOCK - k, 0, nb * BLOCK - n)).view(FP8_DTYPE)
    l4 = _ceil_div(kb, 4) * 4
    ws = w_scale.to(torch.float32)
    if layout == "v1_padded":  # scale_b.t() is [nb, kb] with row stride round_up(kb, 4)
        scale_b = F.pad(ws, (0, l4 - kb))[:, :kb].t()
    elif layout == "v1_contiguous":  # scale_b.t() is [nb, kb] contiguous
        scale_b = ws.contiguous().t()
    elif layout == "v2":  # [round_up(kb, 4), nb] with strides (1, round_up(kb, 4))
        scale_b = F.pad(ws, (0, l4 - kb)).t()
    else:
        raise ValueError(f"unknown scaled_mm layout {layout!r}; known: {_SCALED_MM_LAYOUTS}")
    return PreparedFP8Weight(q.contiguous(), scale_b, n, k, layout)


def scaled_mm_gemm(xq: torch.Tensor, xs: torch.Tensor, w: PreparedFP8Weight, out_dtype: torch.dtype) -> torch.Tensor:
    """The bare kernel call: xq [M, Kp] fp8 (K padded to the weight's Kp, M to a multiple of 16),
    xs [M, Kp/128] fp32 -> [M, Np] in out_dtype (the caller slices [:, :n]).
    quantize_act_for_scaled_mm returns both in the layout wanted here, so nothing is copied."""
    # 1x128 scales must be "outer-dim-major": shape [M, kb] with strides (1, M) (a no-op if they are).
    scale_a = xs.t().contiguous().t()
    if w.layout == "v2":
        from torch.nn.functional import ScalingType, SwizzleType, scaled_mm

        return scaled_mm(xq, w.q.t(), scale_a, ScalingType.BlockWise1x128, w.scale_b, ScalingType.BlockWise128x128,
                         swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=out_dtype)
    return torch._scaled_mm(xq, w.q.t(), scale_a=scale_a, scale_b=w.scale_b, out_dtype=out_dtype)


def quantize_act_for_scaled_mm(x2: torch.Tensor, kp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (q [Mp, Kp] fp8, scale [Mp, Kp/128] fp32 with strides (1, Mp)), Mp = M rounded up to 16.

    Zero padding leaves every tile's amax unchanged, so q[:M, :K] and scale[:M] equal
    quantize_fp8_act(x2) bitwise; padded rows quantize to 0 with scale 1 and are sliced off the output.
    On CUDA one fused Triton kernel (miles/precision/fp8_triton.py, the same bits) does it all.
    """
    if fp8_triton.available(x2):
        return fp8_triton.quantize_act_fused(x2, kp, _M_ALIGN)
    m, k = x2.shape
    xq, xs = quantize_fp8_act(_pad(x2, (0, kp - k, 0, -m % _M_ALIGN)))
    return xq, xs.t().contiguous().t()


def fp8_linear_prepared(x: torch.Tensor, w: PreparedFP8Weight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The engine's FP8 path with a weight prepared once: x [..., K] -> [..., N] (act quant + scaled_mm)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.k:
        raise ValueError(f"x has K={k} but the weight has K={w.k}")
    x2 = x.reshape(-1, k)
    xq, xs = quantize_act_for_scaled_mm(x2, w.q.shape[1])
    y = scaled_mm_gemm(xq, xs, w, out_dtype or x.dtype)
    return y[: x2.shape[0], : w.n].reshape(*lead, w.n)


def _gemm_scaled_mm(x2, q_w, w_scale, out_dtype, layout=None):
    return fp8_linear_prepared(x2, prepare_scaled_mm_weight(q_w, w_scale, layout), out_dtype)


def _gemm_deep_gemm(x2, q_w, w_scale, out_dtype):
    k = q_w.shape[1]
    if k % BLOCK:
        raise ValueError(f"deep_gemm needs K divisible by {BLOCK}, got {k}")
    xq, xs = quantize_fp8_act(x2)
    return _deep_gemm_quantized(xq, xs, q_w, w_scale).to(out_dtype)


def _deep_gemm_quantized(xq, xs, q_w, w_scale):
    """DeepGEMM's FP8 NT GEMM of 1x128-quantized rows and a 128x128-block weight -> bf16 [M, N]."""
    import deep_gemm  # optional: the `gpu` extra

    out = torch.empty(xq.shape[0], q_w.shape[0], dtype=torch.bfloat16, device=xq.device)
    if hasattr(deep_gemm, "fp8_gemm_nt"):  # DeepGEMM 2.x: lays out the scales itself
        deep_gemm.fp8_gemm_nt((xq, xs), (q_w, w_scale.to(torch.float32)), out)
    else:  # DeepGEMM 1.x: LHS scales column-major, TMA-aligned
        xs = deep_gemm.get_col_major_tma_aligned_tensor(xs)
        deep_gemm.gemm_fp8_fp8_bf16_nt((xq, xs), (q_w, w_scale.to(torch.float32)), out)
    return out


def _gemm_triton(x2, q_w, w_scale, out_dtype):
    xq, xs = _quantize_for_triton(x2)
    return fp8_triton_gemm.fp8_gemm_invariant(xq, xs, q_w, w_scale, x2.shape[0], out_dtype)


def _quantize_for_triton(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 codes and scales the Triton GEMM reads (any strides): the fused quantizer's on CUDA."""
    if fp8_triton.available(x2):
        return fp8_triton.quantize_act_fused(x2, _ceil_div(x2.shape[1], BLOCK) * BLOCK)
    return quantize_fp8_act(x2)


def _gemm_emulated(x, q_w, w_scale, out_dtype, quantize_act=True, bias=None):
    if quantize_act:
        xq, xs = quantize_fp8_act(x)
        xd = dequantize_fp8_act(xq, xs, out_dtype)
    else:
        xd = x.to(out_dtype)
    # bias inside F.linear (one addmm), as the training forward does: the sums round the same way.
    return F.linear(xd, dequantize_fp8_weight(q_w, w_scale, out_dtype), None if bias is None else bias.to(out_dtype))


def _probe(backend: str, device: torch.device, layout: str | None = None) -> tuple[bool, str]:
    """Run `backend` once on a small problem with awkward shapes and widely varying block scales;
    pass when it matches the emulated fp32 GEMM to _PROBE_TOL (relative to the output's max)."""
    from miles.precision.fp8 import quantize_fp8_weight

    gen = torch.Generator().manual_seed(0)
    m, n, k = 200, 320, 384  # n, k not multiples of 256 and kb = 3 (round_up(kb, 4) = 4) on purpose
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 5, (1, k // BLOCK), generator=gen)
                                                     .float().repeat_interleave(BLOCK, 1))
    w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-4, 5, (_ceil_div(n, BLOCK), k // BLOCK),
                                                                    generator=gen).float()
                                                      .repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1))
    q_w, w_s = quantize_fp8_weight(w)
    try:
        args = (x.to(device, torch.bfloat16), q_w.to(device), w_s.to(device))
        if backend == "scaled_mm":
            y = _gemm_scaled_mm(*args, torch.bfloat16, layout)
        elif backend == "triton":
            y = _gemm_triton(*args, torch.bfloat16)
        else:
            y = _gemm_deep_gemm(*args, torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure means "not usable here"; the report says why
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    # x went to bf16 before quantization on the device side: compare against the same input.
    ref = _gemm_emulated(x.to(torch.bfloat16), q_w, w_s, torch.float32)
    err = ((y.float().cpu() - ref).abs().max() / ref.abs().max()).item()
    if not err <= _PROBE_TOL:
        return False, f"wrong result: max error {err:.3g} of the output's max (tolerance {_PROBE_TOL})"
    return True, f"max error {err:.2g} of the output's max" + (f", layout {layout}" if layout else "")


def _import_deep_gemm():
    import deep_gemm  # optional: loads its compiled operators, which must match this torch's ABI

    return deep_gemm


def _device(device: torch.device | str | None) -> torch.device:
    """Normalize so "cuda" and "cuda:0" share one probe."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _probe_cached(backend: str, device: torch.device) -> tuple[bool, str]:
    if backend not in BACKENDS:
        raise ValueError(f"unknown fp8 backend {backend!r}; known: {BACKENDS} or 'auto'")
    device = _device(device)
    key = (backend, str(device))
    if key in _PROBES:
        return _PROBES[key]
    if backend == "emulated":
        result = (True, "always available")
    elif device.type != "cuda":
        result = (False, f"needs a CUDA device, got {device}")
    elif backend == "triton":
        result = _probe(backend, device) if fp8_triton_gemm.triton is not None else (False, "triton is not installed")
    elif backend == "scaled_mm":
        if not hasattr(torch, "_scaled_mm"):
            result = (False, "this torch has no torch._scaled_mm")
        else:
            tried = []
            result = (False, "")
            for layout in _SCALED_MM_LAYOUTS:
                ok, why = _probe(backend, device, layout)
                if ok:
                    result = (True, why + (f" (refused: {'; '.join(tried)})" if tried else ""))
                    _LAYOUTS[str(device)] = layout
                    break
                tried.append(f"{layout}: {why}")
            if not result[0]:
                result = (False, "; ".join(tried))
    else:  # deep_gemm
        try:
            _import_deep_gemm()
        except ImportError:
            result = (False, "deep_gemm is not installed (pip install 'miles[gpu]' or deep-gemm from source)")
        except Exception as e:  # noqa: BLE001 - installed but does not load: say why, fall back
            # Seen with sgl-deep-gemm 0.2.5 on torch 2.11: OSError, undefined symbol
            # c10::cuda::CUDAErrorLogCapture (its _C.so was built against a newer torch).
            cause = e.__cause__ or e
            result = (False, f"deep_gemm does not load: {type(cause).__name__}: {str(cause).splitlines()[0][:200]}")
        else:
            result = _probe(backend, device)
    _PROBES[key] = result
    return result


def _scaled_mm_layout(device: torch.device) -> str:
    device = _device(device)
    ok, why = _probe_cached("scaled_mm", device)
    if not ok:
        raise RuntimeError(f"torch._scaled_mm blockwise FP8 is not usable on {device}: {why}")
    return _LAYOUTS[str(device)]


def fp8_backend_report(device: torch.device | str | None = None) -> dict[str, str]:
    """{backend: "ok: ..." | "unavailable: <reason>"} for `device` (default: cuda if present, else cpu)."""
    device = _device(device)
    report = {}
    for b in BACKENDS:
        ok, why = _probe_cached(b, device)
        report[b] = ("ok: " if ok else "unavailable: ") + why
    return report


def resolve_fp8_backend(backend: str = "auto", device: torch.device | str | None = None) -> str:
    """The backend name fp8_linear will use. An explicit backend that cannot run raises with the reason."""
    device = _device(device)
    if backend == "auto":
        return next(b for b in _AUTO_ORDER if _probe_cached(b, device)[0])
    ok, why = _probe_cached(backend, device)
    if not ok:
        raise RuntimeError(f"fp8 backend {backend!r} is not usable on {device}: {why}")
    return backend


def fp8_linear(x: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               backend: str = "auto", out_dtype: torch.dtype | None = None, quantize_act: bool = True) -> torch.Tensor:
    """y = fp8(x) @ W.T (+ bias): x [..., K] high precision, q_w [N, K] fp8, w_scale [ceil(N/128), ceil(K/128)]
    -> [..., N] in out_dtype (default x.dtype).

    x is quantized here in 1x128 tiles by quantize_fp8_act (the same quantizer on every backend).
    quantize_act=False (W8A16) exists for the emulated backend only; "auto" then picks it.
    """
    out_dtype = out_dtype or x.dtype
    if not quantize_act:
        if backend not in ("auto", "emulated"):
            raise ValueError(f"quantize_act=False runs on the emulated backend only, got backend={backend!r}")
        backend = "emulated"
    name = resolve_fp8_backend(backend, x.device)
    lead, k = x.shape[:-1], x.shape[-1]
    if q_w.shape[-1] != k:
        raise ValueError(f"x has K={k} but the weight has K={q_w.shape[-1]}")
    if name == "emulated":
        return _gemm_emulated(x, q_w, w_scale, out_dtype, quantize_act, bias)
    x2 = x.reshape(-1, k)
    gemm = {"scaled_mm": _gemm_scaled_mm, "triton": _gemm_triton, "deep_gemm": _gemm_deep_gemm}[name]
    y = gemm(x2, q_w, w_scale, out_dtype).reshape(*lead, q_w.shape[0])
    return y if bias is None else y + bias.to(y.dtype)


class FP8Operand(NamedTuple):
    """A weight made ready once (per weight sync, or per optimizer step on the training side) for
    fp8_linear_with on `backend`: the payload (q [N, K] fp8, scale [ceil(N/128), ceil(K/128)] fp32)
    and, for scaled_mm, its laid-out copy."""

    backend: str
    q: torch.Tensor
    scale: torch.Tensor
    mm: PreparedFP8Weight | None


def prepare_fp8_weight(q_w: torch.Tensor, w_scale: torch.Tensor, backend: str = "auto") -> FP8Operand:
    name = resolve_fp8_backend(backend, q_w.device)
    return FP8Operand(name, q_w, w_scale, prepare_scaled_mm_weight(q_w, w_scale) if name == "scaled_mm" else None)


def quantize_input(x2: torch.Tensor, w: FP8Operand) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> its 1x128 codes and scales in the layout w's backend reads (scaled_mm: padded,
    outer-dim-major scales; the others: quantize_fp8_act's). Rows [:M], columns [:K] are
    quantize_fp8_act(x2) bitwise on every backend."""
    if w.backend == "scaled_mm":
        return quantize_act_for_scaled_mm(x2, w.mm.q.shape[1])
    if w.backend == "triton":
        return _quantize_for_triton(x2)
    return quantize_fp8_act(x2)


def gemm_quantized(xq: torch.Tensor, xs: torch.Tensor, m: int, w: FP8Operand, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """quantize_input's (xq, xs) of M rows times w -> [M, N] in out_dtype (+ bias), on w's backend.
    Inside batch-invariant kernels (true on-policy) the product is row-count invariant on every
    backend: the emulated GEMM's F.linear is then the invariant matmul, CUDA runs the Triton GEMM."""
    n = w.q.shape[0]
    if w.backend == "emulated" or (invariance.active() and not xq.is_cuda):
        # bias inside F.linear (one addmm), as fake_fp8_linear does: the sums round the same way.
        return F.linear(dequantize_fp8_act(xq, xs, out_dtype), dequantize_fp8_weight(w.q, w.scale, out_dtype),
                        None if bias is None else bias.to(out_dtype))
    if w.backend == "triton" or invariance.active():
        y = fp8_triton_gemm.fp8_gemm_invariant(xq, xs, w.q, w.scale, m, out_dtype)
    elif w.backend == "scaled_mm":
        y = scaled_mm_gemm(xq, xs, w.mm, out_dtype)[:m, :n]
    else:
        y = _deep_gemm_quantized(xq, xs, w.q, w.scale).to(out_dtype)
    return y if bias is None else y + bias.to(y.dtype)


def fp8_linear_with(x: torch.Tensor, w: FP8Operand, bias: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fp8_linear with a prepared weight: x [..., K] -> [..., N] (the same bits as fp8_linear on w's backend)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if k != w.q.shape[-1]:
        raise ValueError(f"x has K={k} but the weight has K={w.q.shape[-1]}")
    x2 = x.reshape(-1, k)
    xq, xs = quantize_input(x2, w)
    return gemm_quantized(xq, xs, x2.shape[0], w, out_dtype or x.dtype, bias).reshape(*lead, w.q.shape[0])
