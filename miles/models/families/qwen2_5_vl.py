"""Qwen2.5-VL: the Qwen2 decoder (q/k/v bias, no QK-norm) with mRoPE, plus the windowed-attention
vision tower of miles.models.vision (the model class is miles.models.vlm.VisionLM).

config.json: transformers 5 writes the decoder under `text_config` and mRoPE under
`rope_parameters`; the published checkpoints keep the decoder keys at the top level and mRoPE in
`rope_scaling` ({"type": "mrope", "mrope_section": ...}); both are read, the first is written.
Tensor names: decoder as Qwen2 (`model.layers...`), the tower under `visual.`, its patch
embedding stored as a Conv3d kernel [E, C, tp, p, p] (ours: the same numbers as a Linear [E, C*tp*p*p]).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from miles.models.families import Family, Tensors, common_arch_kwargs, common_hf_config, register

_PATCH = "visual.patch_embed.proj.weight"


def _problems(arch) -> list[str]:
    if arch.vision is None or not arch.mrope_section:
        return [f"family {arch.family} needs a vision block and mrope_section"]
    if arch.qk_norm or not arch.attention_bias:
        return [f"family {arch.family} (Qwen2 decoder) needs qk_norm=false and attention_bias=true"]
    if arch.moe or arch.mla or arch.dsa or arch.linear_attn or arch.llama4 or arch.mtp_layers:
        return [f"family {arch.family} is dense GQA: remove the moe / mla / dsa / linear_attn / llama4 / mtp blocks"]
    v = arch.vision
    ids = (v.image_token_id, v.video_token_id, v.vision_start_token_id, v.vision_end_token_id)
    if arch.vocab_size and max(ids) >= arch.vocab_size:
        return [f"family {arch.family}: vision token ids {ids} must lie in the vocabulary (vocab_size {arch.vocab_size})"]
    if arch.rope_scaling is not None or arch.partial_rotary_factor != 1.0:
        return [f"family {arch.family}: RoPE scaling and partial rotary are not implemented for it"]
    return []


def _rope_spec(text: dict[str, Any]) -> dict[str, Any]:
    return text.get("rope_parameters") or text.get("rope_scaling") or {}


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig, VisionConfig

    text = {**d, **d.get("text_config", {}), "model_type": d["model_type"]}
    if text.get("use_sliding_window"):
        raise ValueError(f"{d['model_type']}: sliding-window attention is not supported")
    rope = _rope_spec(text)
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", "mrope"):
        raise ValueError(f"{d['model_type']}: unsupported RoPE type {rope!r} (mRoPE only)")
    v = d["vision_config"]
    tokens = {k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
              if k in d}
    vision = VisionConfig(
        depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"],
        in_channels=v.get("in_channels", v.get("in_chans", 3)), patch_size=v["patch_size"],
        temporal_patch_size=v["temporal_patch_size"], spatial_merge_size=v["spatial_merge_size"],
        window_size=v["window_size"], fullatt_block_indexes=list(v["fullatt_block_indexes"]),
        rope_theta=float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        tokens_per_second=v.get("tokens_per_second", 4), **tokens)  # 4: transformers' default
    return ArchConfig(**common_arch_kwargs(text), qk_norm=False, attention_bias=True, vision=vision,
                      mrope_section=list(rope["mrope_section"]))


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    v = arch.vision
    text = common_hf_config(arch, dtype)
    text.update(model_type="qwen2_5_vl_text", use_sliding_window=False, sliding_window=None,
                rope_parameters={"rope_type": "default", "rope_theta": arch.rope_theta,
                                 "mrope_section": list(arch.mrope_section)})
    for key in ("architectures", "tie_word_embeddings", "torch_dtype", "dtype"):
        text.pop(key)
    vision = {f.name: getattr(v, f.name) for f in dataclasses.fields(v) if not f.name.endswith("token_id")}
    vision.pop("rope_theta")
    vision.update(model_type="qwen2_5_vl_vision", hidden_act="silu",
                  rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": arch.family,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": v.image_token_id,
        "video_token_id": v.video_token_id,
        "vision_start_token_id": v.vision_start_token_id,
        "vision_end_token_id": v.vision_end_token_id,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _patch_shape(arch) -> tuple[int, ...]:
    v = arch.vision
    return (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)


def _to_hf_tensors(tensors: Tensors, arch) -> Tensors:
    return {**tensors, _PATCH: tensors[_PATCH].reshape(_patch_shape(arch)).contiguous()}


def _from_hf_tensors(tensors: Tensors, arch) -> Tensors:
    return {**tensors, _PATCH: tensors[_PATCH].reshape(arch.vision.hidden_size, -1)}


register(Family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", _from_hf, _to_hf, _problems,
                renames=((r"^model\.visual\.", "visual."),), renames_back=((r"^visual\.", "model.visual."),),
                to_hf_tensors=_to_hf_tensors, from_hf_tensors=_from_hf_tensors,
                notes="Qwen2 decoder with mRoPE + windowed 2-D RoPE ViT, patch merger (images)"))
