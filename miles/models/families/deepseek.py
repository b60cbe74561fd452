"""DeepSeek-V3 / R1 and Kimi K2 / K2-Thinking / K2.5 (text): MLA + DeepSeek MoE.

Architecture (HF `deepseek_v3`): multi-head latent attention (`miles.models.mla`) with YaRN RoPE
and DeepSeek's softmax-scale correction; the first `first_k_dense_replace` layers have a dense
SwiGLU MLP, the rest a MoE with a sigmoid router, a per-expert score-correction bias used for
selection only, group-limited top-k, `routed_scaling_factor` and one shared expert.

Checkpoints:
  * MTP: the released checkpoints hold `num_nextn_predict_layers` (= mtp_layers) extra decoder
    layers, index num_hidden_layers and up, with copies of the embedding and LM head (layout in
    mtp_io.py); layers past mtp_layers are skipped on load, so mtp_layers: 0 drops them all.
  * Kimi K2 / K2-Thinking ship `model_type: kimi_k2` with DeepseekV3 code: read as deepseek_v3.
  * Kimi K2.5 is multimodal (`kimi_k25`): the text model's config is nested under `text_config`
    and its tensors under `language_model.`; we load the text model and skip the vision tower.
  * K2-Thinking / K2.5 publish routed experts INT4-quantized (compressed-tensors); the loader
    reads plain floating-point tensors only (dequantize first).
Tensor names equal HF's minus the leading "model."; MoE expert tensors follow the MoE module.

The YaRN helpers here (`rope_scaling_from_hf`, `rope_parameters_to_hf`) serve every MLA family.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, common_arch_kwargs, common_hf_config, get_family, register
from miles.models.families.moe_io import fuse_experts, split_experts
from miles.models.families.mtp_io import from_published, ignored_layers, to_published

# Kimi K2.5 (multimodal) nests the language model under this prefix, beside its vision side.
_TEXT_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "vision_model.", "mm_projector.", "multi_modal_projector.")


# -- RoPE scaling (YaRN) <-> config.json ------------------------------------------------------

def rope_scaling_from_hf(d: dict[str, Any]):
    """RopeScalingConfig of a config.json (transformers 5 `rope_parameters` or < 5 `rope_scaling`),
    None when unscaled. Only YaRN is read here."""
    from miles.models.config import RopeScalingConfig

    spec = {}
    for candidate in (d.get("rope_parameters") or {}, d.get("rope_scaling") or {}):
        if candidate.get("rope_type", candidate.get("type", "default")) != "default":
            spec = candidate
            break
    if not spec:
        return None
    kind = spec.get("rope_type", spec.get("type"))
    if kind != "yarn":
        raise ValueError(f"{d.get('model_type')}: unsupported RoPE scaling type {kind!r} (yarn only)")
    original = spec.get("original_max_position_embeddings") or d["max_position_embeddings"]
    # transformers: a missing factor is the ratio of the extended to the original context
    factor = spec.get("factor") or d["max_position_embeddings"] / original
    return RopeScalingConfig(
        type="yarn", factor=float(factor), original_max_position_embeddings=int(original),
        beta_fast=float(spec.get("beta_fast") or 32), beta_slow=float(spec.get("beta_slow") or 1),
        mscale=float(spec.get("mscale") or 0.0), mscale_all_dim=float(spec.get("mscale_all_dim") or 0.0),
        attention_factor=float(spec.get("attention_factor") or 0.0),
        truncate=bool(spec.get("truncate", True)),
    )


def rope_parameters_to_hf(arch) -> dict[str, Any]:
    """The config.json `rope_parameters` of an arch (plain or YaRN)."""
    s = arch.rope_scaling
    if s is None:
        return {"rope_type": "default", "rope_theta": arch.rope_theta}
    if s.type != "yarn":
        raise ValueError(f"{arch.family}: rope_scaling.type {s.type!r} is not supported (yarn only)")
    out = {"rope_type": "yarn", "rope_theta": arch.rope_theta, "factor": s.factor,
           "original_max_position_embeddings": s.original_max_position_embeddings,
           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow}
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if getattr(s, key):
            out[key] = getattr(s, key)
    if not s.truncate:
        out["truncate"] = False
    return out


# -- shared by the MLA + MoE families (deepseek_v3, glm4_moe_lite) ----------------------------

def mla_from_hf(d: dict[str, Any]):
    from miles.models.config import MLAConfig

    return MLAConfig(q_lora_rank=d.get("q_lora_rank") or 0, kv_lora_rank=d["kv_lora_rank"],
                     qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
                     v_head_dim=d["v_head_dim"], rope_interleave=bool(d.get("rope_interleave", True)))


def mla_moe_arch_kwargs(d: dict[str, Any]) -> dict[str, Any]:
    """ArchConfig kwargs of an MLA + sigmoid-router MoE config.json (everything but the dense-layer
    pattern, which the families spell differently)."""
    from miles.models.config import MoEConfig

    if (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{d.get('model_type')}: partial rotary inside MLA's rope dims is not supported")
    mla = mla_from_hf(d)
    kwargs = common_arch_kwargs(d)
    kwargs.update(
        # head_dim means the per-head q/k width here; kv heads are as many as query heads.
        head_dim=mla.qk_nope_head_dim + mla.qk_rope_head_dim,
        num_kv_heads=d["num_attention_heads"],
        attention_bias=bool(d.get("attention_bias", False)),
        qk_norm=False,
        mla=mla,
        rope_scaling=rope_scaling_from_hf(d),
        mtp_layers=int(d.get("num_nextn_predict_layers") or 0),
        moe=MoEConfig(
            num_experts=d["n_routed_experts"], num_experts_per_tok=d["num_experts_per_tok"],
            moe_intermediate_size=d["moe_intermediate_size"], scoring=d.get("scoring_func", "sigmoid"),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            score_correction_bias=True, n_group=d.get("n_group") or 1, topk_group=d.get("topk_group") or 1,
            num_shared_experts=d.get("n_shared_experts") or 0,
        ),
    )
    return kwargs


def mla_moe_hf_config(arch, dtype: str) -> dict[str, Any]:
    """config.json keys shared by deepseek_v3 and glm4_moe_lite."""
    m, moe = arch.mla, arch.moe
    out = common_hf_config(arch, dtype)
    rope = rope_parameters_to_hf(arch)
    out.update(
        # HF derives head_dim from qk_rope_head_dim (Glm4MoeLite even aliases the two names).
        head_dim=m.qk_rope_head_dim, num_key_value_heads=arch.num_heads,
        q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=m.rope_interleave,
        rope_parameters=rope, attention_bias=arch.attention_bias,
        n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=moe.num_shared_experts,
        routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.norm_topk_prob,
        n_group=moe.n_group, topk_group=moe.topk_group, scoring_func=moe.scoring, topk_method="noaux_tc",
        num_nextn_predict_layers=arch.mtp_layers,
    )
    if rope["rope_type"] != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}  # < 5 spelling
    return out


def mla_moe_problems(arch) -> list[str]:
    """What the HF MLA + MoE families (and our implementation of them) can represent."""
    out = []
    name = arch.family
    if arch.mla is None or arch.moe is None:
        return [f"family {name} needs both an mla and a moe block (moe.first_k_dense >= num_layers: all dense)"]
    m, moe = arch.mla, arch.moe
    if arch.num_kv_heads != arch.num_heads:
        out.append(f"family {name}: num_kv_heads must equal num_heads ({arch.num_heads}) with MLA")
    if arch.head_dim != m.qk_nope_head_dim + m.qk_rope_head_dim:
        out.append(f"family {name}: head_dim must be mla.qk_nope_head_dim + mla.qk_rope_head_dim "
                   f"({m.qk_nope_head_dim + m.qk_rope_head_dim})")
    if m.qk_rope_head_dim % 2:
        out.append(f"family {name}: mla.qk_rope_head_dim must be even")
    if arch.qk_norm or arch.partial_rotary_factor != 1.0 or arch.tie_word_embeddings:
        out.append(f"family {name}: qk_norm, partial_rotary_factor and tie_word_embeddings are not part of it")
    if arch.dsa or arch.linear_attn or arch.llama4:
        out.append(f"family {name}: remove the dsa / linear_attn / llama4 blocks")
    if arch.rope_scaling is not None and arch.rope_scaling.type != "yarn":
        out.append(f"family {name}: rope_scaling.type must be yarn")
    if moe.scoring != "sigmoid" or not moe.score_correction_bias or moe.shared_expert_gate or moe.layer_freq != 1:
        out.append(f"family {name}: moe needs scoring=sigmoid, score_correction_bias=true, "
                   "shared_expert_gate=false, layer_freq=1")
    if moe.num_experts % moe.n_group or moe.topk_group > moe.n_group:
        out.append(f"family {name}: moe.num_experts must divide into moe.n_group groups, topk_group <= n_group")
    if moe.shared_expert_intermediate_size not in (0, moe.moe_intermediate_size * moe.num_shared_experts):
        out.append(f"family {name}: the shared expert width is moe_intermediate_size x num_shared_experts; "
                   "leave moe.shared_expert_intermediate_size at 0")
    return out


# -- deepseek_v3 ------------------------------------------------------------------------------

def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig

    kwargs = mla_moe_arch_kwargs(d)
    kwargs["family"] = "deepseek_v3"  # kimi_k2 checkpoints are this architecture
    kwargs["moe"].first_k_dense = d.get("first_k_dense_replace", 3)
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"{d.get('model_type')}: moe_layer_freq != 1 is not supported")
    return ArchConfig(**kwargs)


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    out = mla_moe_hf_config(arch, dtype)
    out["first_k_dense_replace"] = arch.moe.first_k_dense
    out["moe_layer_freq"] = 1
    return out


def _problems(arch) -> list[str]:
    out = mla_moe_problems(arch)
    if arch.mlp_only_layers:
        out.append("family deepseek_v3: dense layers are the first moe.first_k_dense only; clear mlp_only_layers")
    return out


NOTES = ("MLA (q/kv LoRA, latent KV cache), YaRN, sigmoid router + correction bias, group-limited top-k, "
         "routed scaling, shared expert, dense-first layers, MTP layers")


def _ignored(name: str, arch) -> bool:
    """MTP layers we do not build; the vision side of a multimodal (Kimi K2.5) checkpoint."""
    name = name[len(_TEXT_PREFIX):] if name.startswith(_TEXT_PREFIX) else name
    return name.startswith(_VISION_PREFIXES) or ignored_layers(name, arch)


def to_checkpoint(tensors, arch, mtp_copies: bool = True):
    """Our HF-named tensors -> the checkpoint layout of this lineage: MTP depths as the decoder layers
    past the main ones (with the embedding / head copies where the release has them), one matrix per
    expert (the layout checkpoints, transformers and serving engines read)."""
    return split_experts(to_published(tensors, arch, mtp_copies))


def from_checkpoint(tensors, arch):
    """Inverse of `to_checkpoint`: fused experts, MTP layers under our names (copies checked, dropped)."""
    return from_published(fuse_experts(tensors), arch)


def _from_hf_tensors(tensors, arch):
    # Kimi K2.5 nests the language model under "language_model."
    tensors = {k[len(_TEXT_PREFIX):] if k.startswith(_TEXT_PREFIX) else k: v for k, v in tensors.items()}
    return from_checkpoint(tensors, arch)


register(Family("deepseek_v3", "DeepseekV3ForCausalLM", _from_hf, _to_hf, _problems,
                to_hf_tensors=to_checkpoint, from_hf_tensors=_from_hf_tensors, ignored=_ignored,
                notes=NOTES))
# Kimi K2 / K2-Thinking config.json say model_type "kimi_k2" (remote code = DeepSeek-V3's); the
# arch read is deepseek_v3, whose tensor hooks then apply.
def _alias_problems(arch) -> list[str]:
    return [f"family {arch.family} is read from checkpoints as deepseek_v3: write family: deepseek_v3"]


register(Family("kimi_k2", "DeepseekV3ForCausalLM", _from_hf, _to_hf, _alias_problems, notes="read as deepseek_v3"))


# -- kimi_k25: the text model of Kimi K2.5 (multimodal checkpoint) ----------------------------
# From memory of the release (not verifiable offline): config.json has model_type "kimi_k25", the
# DeepSeek-V3 text config nested under "text_config", language-model tensors under
# "language_model.model.*" / "language_model.lm_head.*", and the vision tower and projector
# beside them. The arch read from it is deepseek_v3, so the deepseek_v3 tensor hooks above strip
# the prefix and skip the vision tensors.


def _k25_from_hf(d: dict[str, Any]):
    text = dict(d.get("text_config") or d)
    if text.get("model_type") in (None, "kimi_k25"):
        text["model_type"] = "deepseek_v3"
    return get_family(text["model_type"]).from_hf_config(text)


register(Family("kimi_k25", "DeepseekV3ForCausalLM", _k25_from_hf, _to_hf, _alias_problems,
                notes="text model of Kimi K2.5, read as deepseek_v3"))
