"""GLM-4.5V (`glm4v_moe`): the GLM-4.x MoE decoder (glm4_moe.py; GLM-4.5-Air's sizes, no QK-norm)
with mRoPE over its partial rotary width (consecutive t / h / w sections), and the GLM-4.5V vision
tower (miles.models.vision_glm4v); the model class is miles.models.vlm.VisionLM.

config.json and tensor names: the layout of miles.models.families.vlm_io. The image span tokens are
`image_start_token_id` / `image_end_token_id` (ours: vision_start / vision_end_token_id); the video
span tokens `video_start_token_id` / `video_end_token_id` are kept as they are (a video's frames are
image tokens inside such a span: miles.models.vlm); a config without them leaves them None and
writes none (transformers then fills in its defaults, the released values).
`vision_config.image_size` / patch_size is the side of the learned position grid. Experts are
one tensor per expert on disk (moe_io). The released checkpoint also holds an MTP layer
(`model.language_model.layers.<num_layers>`) that transformers' Glm4vMoe has no module for; it is
skipped on load.
"""

from __future__ import annotations

import re
from typing import Any

from miles.models.families import Family, Tensors, register
from miles.models.families.moe_io import fuse_experts, split_experts
from miles.models.families.vlm_io import (LANGUAGE_MODEL_RENAMES, LANGUAGE_MODEL_RENAMES_BACK, decoder_arch,
                                          decoder_hf_config, decoder_problems, kernels_from_hf, kernels_to_hf,
                                          mrope_section_of, vision_problems, vision_rope_theta)

_PATCH = "model.visual.patch_embed.proj.weight"
_DOWNSAMPLE = "model.visual.downsample.weight"
_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def _problems(arch) -> list[str]:
    out = vision_problems(arch) + decoder_problems(arch, "glm4_moe")
    if arch.qk_norm:
        out.append("family glm4v_moe: qk_norm must be false (HF Glm4vMoe attention has no QK-norm)")
    if arch.mtp_layers:
        out.append("family glm4v_moe: mtp_layers must be 0 (transformers' Glm4vMoe has no MTP module; "
                   "the checkpoint's MTP layer is skipped on load)")
    if arch.mrope_interleaved:
        out.append("family glm4v_moe: mRoPE sections are consecutive: set mrope_interleaved=false")
    if arch.vision is not None and arch.vision.deepstack_visual_indexes:
        out.append("family glm4v_moe: the GLM-4.5V tower has no DeepStack (vision.deepstack_visual_indexes: [])")
    return out


def _from_hf(d: dict[str, Any]):
    from miles.models.config import VisionConfig

    v = d["vision_config"]
    if v.get("attention_bias"):
        raise ValueError("glm4v_moe: vision_config.attention_bias=true is not implemented (released: false)")
    tokens = {ours: d[theirs] for ours, theirs in (("image_token_id", "image_token_id"),
                                                   ("video_token_id", "video_token_id"),
                                                   ("vision_start_token_id", "image_start_token_id"),
                                                   ("vision_end_token_id", "image_end_token_id"),
                                                   ("video_start_token_id", "video_start_token_id"),
                                                   ("video_end_token_id", "video_end_token_id")) if theirs in d}
    vision = VisionConfig(
        depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"], in_channels=v.get("in_channels", 3),
        patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
        spatial_merge_size=v["spatial_merge_size"], num_position_embeddings=(v["image_size"] // v["patch_size"]) ** 2,
        norm_eps=float(v.get("rms_norm_eps", 1e-5)), rope_theta=vision_rope_theta(v), **tokens)
    return decoder_arch(d, "glm4_moe", {}, vision=vision, mrope_section=mrope_section_of(d))


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    v = arch.vision
    text = decoder_hf_config(arch, dtype, "glm4_moe", "glm4v_moe_text")
    side = round(v.num_position_embeddings ** 0.5)
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, hidden_act="silu", attention_bias=False,
                  intermediate_size=v.intermediate_size, num_heads=v.num_heads, in_channels=v.in_channels,
                  out_hidden_size=v.out_hidden_size, image_size=side * v.patch_size, patch_size=v.patch_size,
                  temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
                  rms_norm_eps=v.norm_eps, model_type="glm4v_moe_vision",
                  rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    spans = {key: getattr(v, key) for key in ("video_start_token_id", "video_end_token_id")
             if getattr(v, key) is not None}
    return {
        "architectures": ["Glm4vMoeForConditionalGeneration"],
        "model_type": arch.family,
        "text_config": text,
        "vision_config": vision,
        "image_token_id": v.image_token_id,
        "video_token_id": v.video_token_id,
        "image_start_token_id": v.vision_start_token_id,
        "image_end_token_id": v.vision_end_token_id,
        **spans,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "dtype": dtype,
        "torch_dtype": dtype,
    }


def _kernel_shapes(arch) -> dict[str, tuple[int, ...]]:
    v = arch.vision
    m = v.spatial_merge_size
    return {_PATCH: (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
            _DOWNSAMPLE: (v.out_hidden_size, v.hidden_size, m, m)}


def _to_hf_tensors(tensors: Tensors, arch) -> Tensors:
    return split_experts(kernels_to_hf(tensors, _kernel_shapes(arch)))


def _from_hf_tensors(tensors: Tensors, arch) -> Tensors:
    return fuse_experts(kernels_from_hf(tensors, (_PATCH, _DOWNSAMPLE)))


def _mtp_layer(name: str, arch) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= arch.num_layers


register(Family("glm4v_moe", "Glm4vMoeForConditionalGeneration", _from_hf, _to_hf, _problems,
                renames=LANGUAGE_MODEL_RENAMES, renames_back=LANGUAGE_MODEL_RENAMES_BACK,
                to_hf_tensors=_to_hf_tensors, from_hf_tensors=_from_hf_tensors, ignored=_mtp_layer,
                notes="GLM-4.x MoE decoder (no QK-norm) with mRoPE on its partial rotary width + GLM-4.5V ViT "
                      "(learned bicubic positions, conv downsample, SwiGLU merger) (images)"))
