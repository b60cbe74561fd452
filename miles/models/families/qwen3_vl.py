"""Qwen3-VL (`qwen3_vl`: the Qwen3 dense decoder) and Qwen3-VL-MoE (`qwen3_vl_moe`: the Qwen3-MoE
decoder), both with interleaved mRoPE and the Qwen3-VL vision tower (miles.models.vision_qwen3:
learned position grid, DeepStack); the model class is miles.models.vlm.VisionLM.

config.json and tensor names: the layout of miles.models.families.vlm_io (`text_config`,
`vision_config`, `model.language_model.*`, `model.visual.*`). Released files put mRoPE under
`rope_scaling` with `mrope_interleaved: true`; transformers 5 writes `rope_parameters` and always
interleaves for these families, so both read as interleaved.
The MoE decoder's fused experts are stored as the release stores them, transposed against ours
and transformers 5's in-memory layout: `experts.gate_up_proj` [E, H, 2I], `experts.down_proj`
[E, I, H]. transformers 5 saves its own layout ([E, 2I, H] / [E, H, I]) and reads both, telling
them apart by shape, as we do; hence hidden_size must differ from moe_intermediate_size and from
twice it.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, Tensors, register
from miles.models.families.vlm_io import (LANGUAGE_MODEL_RENAMES, LANGUAGE_MODEL_RENAMES_BACK, decoder_arch,
                                          decoder_hf_config, decoder_problems, kernels_from_hf, kernels_to_hf,
                                          mrope_section_of, vision_problems, vision_rope_theta)

_TEXT_FAMILY = {"qwen3_vl": "qwen3", "qwen3_vl_moe": "qwen3_moe"}
_ARCHITECTURES = {"qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}
_PATCH = "model.visual.patch_embed.proj.weight"
_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def _problems(arch) -> list[str]:
    out = vision_problems(arch) + decoder_problems(arch, _TEXT_FAMILY[arch.family])
    if not arch.mrope_interleaved:
        out.append(f"family {arch.family} interleaves its mRoPE axes: set mrope_interleaved=true")
    if arch.vision is not None and any(not 0 <= i < arch.vision.depth for i in arch.vision.deepstack_visual_indexes):
        out.append(f"vision.deepstack_visual_indexes {arch.vision.deepstack_visual_indexes} must be ViT blocks "
                   f"(0 .. {arch.vision.depth - 1})")
    if arch.vision is not None and len(arch.vision.deepstack_visual_indexes) > arch.num_layers:
        out.append("more DeepStack features (vision.deepstack_visual_indexes) than decoder layers")
    moe = arch.moe
    if arch.family == "qwen3_vl_moe" and moe is not None:
        if not moe.norm_topk_prob:
            out.append("family qwen3_vl_moe: moe.norm_topk_prob must be true (HF Qwen3-VL-MoE always renormalizes)")
        if arch.hidden_size in (moe.moe_intermediate_size, 2 * moe.moe_intermediate_size):
            out.append("family qwen3_vl_moe: hidden_size must differ from moe_intermediate_size and twice it "
                       "(the stored expert layout is told apart from the transposed one by shape)")
    return out


def _from_hf(d: dict[str, Any]):
    from miles.models.config import VisionConfig

    v = d["vision_config"]
    vision = VisionConfig(
        depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"], in_channels=v.get("in_channels", 3),
        patch_size=v["patch_size"], temporal_patch_size=v["temporal_patch_size"],
        spatial_merge_size=v["spatial_merge_size"], num_position_embeddings=v["num_position_embeddings"],
        deepstack_visual_indexes=list(v.get("deepstack_visual_indexes") or []), rope_theta=vision_rope_theta(v),
        **{k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
           if k in d})
    # HF Qwen3-VL-MoE's router renormalizes the top-k weights whatever norm_topk_prob says.
    overrides = {"norm_topk_prob": True} if d["model_type"] == "qwen3_vl_moe" else {}
    return decoder_arch(d, _TEXT_FAMILY[d["model_type"]], overrides, vision=vision,
                        mrope_section=mrope_section_of(d), mrope_interleaved=True)


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    v = arch.vision
    text_family = _TEXT_FAMILY[arch.family]
    text = decoder_hf_config(arch, dtype, text_family, f"{arch.family}_text")
    vision = dict(depth=v.depth, hidden_size=v.hidden_size, hidden_act="gelu_pytorch_tanh",
                  intermediate_size=v.intermediate_size, num_heads=v.num_heads, in_channels=v.in_channels,
                  out_hidden_size=v.out_hidden_size, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                  spatial_merge_size=v.spatial_merge_size, num_position_embeddings=v.num_position_embeddings,
                  deepstack_visual_indexes=list(v.deepstack_visual_indexes), model_type=f"{arch.family}_vision",
                  rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    return {
        "architectures": [_ARCHITECTURES[arch.family]],
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
    out = kernels_to_hf(tensors, {_PATCH: _patch_shape(arch)})
    # Fused experts: ours [E, 2I, H] / [E, H, I] -> the release's [E, H, 2I] / [E, I, H].
    return {k: t.transpose(1, 2).contiguous() if k.endswith(_EXPERTS) else t for k, t in out.items()}


def _from_hf_tensors(tensors: Tensors, arch) -> Tensors:
    out = kernels_from_hf(tensors, (_PATCH,))
    if arch.moe is None:
        return out
    h, i = arch.hidden_size, arch.moe.moe_intermediate_size
    ours = {".mlp.experts.gate_up_proj": (2 * i, h), ".mlp.experts.down_proj": (h, i)}
    for name, t in out.items():
        suffix = next((s for s in ours if name.endswith(s)), None)
        if suffix is not None and tuple(t.shape[1:]) != ours[suffix]:  # the release's transposed layout
            out[name] = t.transpose(1, 2).contiguous()
    return out


_NOTES = {"qwen3_vl": "Qwen3 decoder with interleaved mRoPE + Qwen3-VL ViT (learned positions, DeepStack) (images)",
          "qwen3_vl_moe": "Qwen3-MoE decoder with interleaved mRoPE + Qwen3-VL ViT (learned positions, DeepStack) "
                          "(images)"}
for _name, _architecture in _ARCHITECTURES.items():
    register(Family(_name, _architecture, _from_hf, _to_hf, _problems,
                    renames=LANGUAGE_MODEL_RENAMES, renames_back=LANGUAGE_MODEL_RENAMES_BACK,
                    to_hf_tensors=_to_hf_tensors, from_hf_tensors=_from_hf_tensors, notes=_NOTES[_name]))
