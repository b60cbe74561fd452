"""What the vision-language families built on a text family's decoder share (qwen3_vl.py,
glm4v_moe.py): the transformers 5 checkpoint layout, and the text family's own config reading,
writing and checks applied to the decoder, so a VLM's decoder obeys every rule of its text family.

config.json: the decoder's keys under `text_config` (released files and transformers 5 alike), the
tower's under `vision_config`, the image token ids and `tie_word_embeddings` at the top level (a
`text_config.tie_word_embeddings` is not what transformers ties by).
Tensor names: `model.language_model.*` (decoder), `model.visual.*` (tower), `lm_head.*`; ours drop
"model." and "language_model.". Stride = kernel convolutions (the patch embedding, GLM's
downsample) are stored as kernels [E, C, *k]; ours are Linears [E, C * prod(k)], the same numbers.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from miles.models.families import Tensors, get_family

LANGUAGE_MODEL_RENAMES = ((r"^model\.(?!visual\.)", "model.language_model."),)
LANGUAGE_MODEL_RENAMES_BACK = ((r"^model\.language_model\.", "model."),)


def decoder_arch(d: dict[str, Any], text_family: str, overrides: dict[str, Any], **vlm_fields):
    """The VLM's ArchConfig: its decoder read by the text family's own reader (with its refusals)
    from `text_config` updated by `overrides`, then the family renamed and `vlm_fields` (vision,
    mrope_section, ...) set."""
    text = {**d, **d.get("text_config", {}), **overrides, "model_type": text_family,
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", False))}
    base = get_family(text_family).from_hf_config(text)
    return dataclasses.replace(base, family=d["model_type"], **vlm_fields)


def as_decoder(arch, text_family: str):
    """The VLM's decoder as an ArchConfig of its text family (copied, not re-validated)."""
    text = copy.copy(arch)
    text.family, text.vision, text.mrope_section, text.mrope_interleaved = text_family, None, [], False
    return text


def decoder_problems(arch, text_family: str) -> list[str]:
    """The text family's checks on the decoder, each naming the VLM family."""
    return [f"{arch.family} decoder ({text_family} rules): {p}"
            for p in get_family(text_family).problems(as_decoder(arch, text_family))]


def decoder_hf_config(arch, dtype: str, text_family: str, text_model_type: str) -> dict[str, Any]:
    """`text_config`: the text family's config.json of the decoder, with mRoPE in rope_parameters."""
    text = get_family(text_family).to_hf_config(as_decoder(arch, text_family), dtype)
    for key in ("architectures", "tie_word_embeddings", "torch_dtype", "dtype"):
        text.pop(key, None)
    text["model_type"] = text_model_type
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(arch.mrope_section)}
    return text


def mrope_section_of(d: dict[str, Any]) -> list[int]:
    """mRoPE sections: `rope_parameters` (transformers 5) or `rope_scaling` (released files)."""
    text = d.get("text_config", d)
    for spec in (text.get("rope_parameters") or {}, text.get("rope_scaling") or {}):
        if "mrope_section" in spec:
            return list(spec["mrope_section"])
    raise ValueError(f"{d['model_type']}: config.json names no mrope_section (text_config.rope_parameters)")


def vision_rope_theta(v: dict[str, Any]) -> float:
    """The ViT's 2-D rotary base (vision_config.rope_parameters; transformers' default 10000)."""
    return float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def vision_problems(arch) -> list[str]:
    """A vision block, mRoPE sections, image token ids inside the vocabulary and a square learned
    position grid."""
    if arch.vision is None or not arch.mrope_section:
        return [f"family {arch.family} needs a vision block and mrope_section"]
    v = arch.vision
    ids = (v.image_token_id, v.video_token_id, v.vision_start_token_id, v.vision_end_token_id)
    if arch.vocab_size and max(ids) >= arch.vocab_size:
        return [f"family {arch.family}: vision token ids {ids} must lie in the vocabulary (vocab_size {arch.vocab_size})"]
    side = round(v.num_position_embeddings ** 0.5)
    if side < 1 or side * side != v.num_position_embeddings:
        return [f"family {arch.family}: vision.num_position_embeddings ({v.num_position_embeddings}) must be a "
                "positive square (the learned position grid is side x side)"]
    return []


def kernels_to_hf(tensors: Tensors, kernel_shapes: dict[str, tuple[int, ...]]) -> Tensors:
    """Our Linear weights of stride = kernel convolutions -> the checkpoint's kernels (name -> shape)."""
    return {**tensors, **{name: tensors[name].reshape(shape).contiguous() for name, shape in kernel_shapes.items()}}


def kernels_from_hf(tensors: Tensors, names: tuple[str, ...]) -> Tensors:
    """The checkpoint's convolution kernels [E, C, *k] -> our Linear weights [E, C * prod(k)]."""
    kernels = {name: tensors[name] for name in names if name in tensors}  # a missing one is reported by hf_io
    return {**tensors, **{name: k.reshape(k.shape[0], -1) for name, k in kernels.items()}}
