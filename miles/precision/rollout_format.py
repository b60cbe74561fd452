"""What weight sync carries per precision recipe, and how the engine rebuilds its weights from it.

`rollout_format(weights, "fp8")`   name -> q (float8_e4m3fn, same shape), name + "_scale_inv" -> fp32
                                    128x128 block scales (the DeepSeek-V3 / SGLang checkpoint names)
`rollout_format(weights, "int4")`  name + "_packed" -> uint8 [..., N, ceil(K/2)] (see int4.py for the
                                    nibble order), name + "_scale" -> fp32 [..., N, ceil(K/group)],
                                    name + "_shape" -> int64 [..., N, K] original shape (a CPU tensor)
`rollout_format(weights, "none")`  every tensor as is.

Only floating-point tensors with at least 2 dims are quantized (Linear weights and stacked MoE
experts [E, N, K]); everything for which `keep_high_precision(name)` is true (default: embeddings,
lm_head, norms, router gates) travels unchanged. The output dict is ordered by key and every tensor is
contiguous, so `rollout_checksum` of the trainer's side and of what the engine received agree exactly.

`from_rollout_format(fmt, recipe, dtype)` gives back name -> dense weight, dequantized by the same
functions the trainer's fake quantization uses: with `dtype` equal to the trainer's compute dtype the
engine's weights equal the trainer's forward weights bit for bit.
"""

from __future__ import annotations

import hashlib
import re
from typing import Callable, Iterable, Mapping

import torch

from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.int4 import dequantize_int4, pack_int4, quantize_int4

RECIPES = ("none", "fp8", "int4")
FP8_SCALE_SUFFIX = "_scale_inv"
INT4_SUFFIXES = ("_packed", "_scale", "_shape")

# Kept in high precision by default, as DeepSeek-V3 / SGLang FP8 checkpoints do: the embedding and the
# output head (vocabulary-sized, sensitive, cheap to keep), every norm, MoE routers (`gate`, Llama 4's
# `router`: routing decisions flip on small errors, and Llama4MoE reads its router's weight directly),
# the shared-expert gate and linear attention's depthwise `conv1d` kernels (not a GEMM: nothing to gain).
# The vision tower (`visual.`: the released FP8 VLMs keep it in bf16) and the DSA indexer's head
# weights (`weights_proj`, kept in high precision by DeepSeek-V3.2's FP8 release) are never quantized.
DEFAULT_KEEP_PATTERNS = (r"embed_tokens", r"lm_head", r"norm", r"(^|\.)(gate|router)\.weight$", r"shared_expert_gate",
                         r"conv1d", r"^visual\.", r"weights_proj")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def high_precision_predicate(patterns: Iterable[str] = DEFAULT_KEEP_PATTERNS, first_n: int = 0, last_n: int = 0,
                             num_layers: int | None = None) -> Callable[[str], bool]:
    """A `keep_high_precision(name) -> bool` for rollout_format and the recipes.

    True when a regex in `patterns` matches (re.search) or the name is in one of the first `first_n` or
    last `last_n` decoder layers (`...layers.<i>....`; last_n needs `num_layers`).
    """
    regexes = [re.compile(p) for p in patterns]
    if last_n and num_layers is None:
        raise ValueError("last_n needs num_layers")

    def keep(name: str) -> bool:
        if any(r.search(name) for r in regexes):
            return True
        m = _LAYER.search(name)
        if m is None:
            return False
        i = int(m.group(1))
        return i < first_n or (bool(last_n) and i >= num_layers - last_n)

    return keep


def _quantizable(name: str, t: torch.Tensor, keep: Callable[[str], bool]) -> bool:
    return t.is_floating_point() and t.dim() >= 2 and not keep(name)


def rollout_format(weights: Mapping[str, torch.Tensor], recipe: str,
                   keep_high_precision: Callable[[str], bool] | None = None,
                   group: int = 128) -> dict[str, torch.Tensor]:
    """weights: name -> tensor (the trainer's master weights) -> the key-sorted dict weight sync carries."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown rollout format {recipe!r}; known: {RECIPES}")
    keep = keep_high_precision or high_precision_predicate()
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        t = t.detach()
        if recipe == "none" or not _quantizable(name, t, keep):
            out[name] = t.contiguous()
            continue
        if any(name + suffix in weights for suffix in (FP8_SCALE_SUFFIX, *INT4_SUFFIXES)):
            raise ValueError(f"{name!r} would collide with another weight's quantization entries")
        if recipe == "fp8":
            q, s = quantize_fp8_weight(t)
            out[name], out[name + FP8_SCALE_SUFFIX] = q, s.contiguous()
        else:
            q, s = quantize_int4(t, group)
            out[name + "_packed"] = pack_int4(q)
            out[name + "_scale"] = s.contiguous()
            out[name + "_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
    return dict(sorted(out.items()))


def from_rollout_format(fmt: Mapping[str, torch.Tensor], recipe: str, dtype: torch.dtype = torch.float32,
                        group: int = 128) -> dict[str, torch.Tensor]:
    """The engine's side: name -> dense weight. Quantized entries are dequantized to `dtype` (pass the
    trainer's compute dtype); entries that travelled unchanged come back as they are. Key-sorted."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown rollout format {recipe!r}; known: {RECIPES}")
    out: dict[str, torch.Tensor] = {}
    if recipe == "none":
        return dict(sorted(fmt.items()))
    if recipe == "fp8":
        for name, t in fmt.items():
            if name.endswith(FP8_SCALE_SUFFIX) and name[: -len(FP8_SCALE_SUFFIX)] in fmt:
                continue
            scale = fmt.get(name + FP8_SCALE_SUFFIX)
            out[name] = t if scale is None else dequantize_fp8_weight(t, scale, dtype)
    else:
        for name, t in fmt.items():
            if name.endswith("_packed") and (base := name[: -len("_packed")]) + "_scale" in fmt:
                shape = [int(d) for d in fmt[base + "_shape"].tolist()]
                out[base] = dequantize_int4(t, fmt[base + "_scale"], group, k=shape[-1], dtype=dtype).reshape(shape)
            elif any(name.endswith(s) and name[: -len(s)] + "_packed" in fmt for s in ("_scale", "_shape")):
                continue
            else:
                out[name] = t
    return dict(sorted(out.items()))


def quantized_names(fmt: Mapping[str, torch.Tensor], recipe: str) -> list[str]:
    """The original weight names that travel quantized in `fmt` (sorted)."""
    if recipe == "fp8":
        return sorted(n[: -len(FP8_SCALE_SUFFIX)] for n in fmt if n.endswith(FP8_SCALE_SUFFIX)
                      and n[: -len(FP8_SCALE_SUFFIX)] in fmt)
    if recipe == "int4":
        return sorted(n[: -len("_packed")] for n in fmt if n.endswith("_packed") and n[: -7] + "_scale" in fmt)
    return []


def rollout_checksum(fmt: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (key, dtype, shape, raw bytes) in key order: equal iff the two sides hold the same bits."""
    h = hashlib.sha256()
    for name in sorted(fmt):
        t = fmt[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
