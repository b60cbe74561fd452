"""Llama 4 (Scout, Maverick): `llama4_text` (Llama4ForCausalLM) and the published `llama4` checkpoints.

Config mapping (HF Llama4TextConfig -> ArchConfig):
  intermediate_size_mlp        -> intermediate_size (dense layers)
  intermediate_size            -> moe.moe_intermediate_size (one expert, and the shared expert)
  num_local_experts / num_experts_per_tok -> moe.num_experts / moe.num_experts_per_tok
  moe_layers / interleave_moe_layer_step  -> moe.layer_freq (+ mlp_only_layers for other lists)
  no_rope_layers / no_rope_layer_interval -> llama4.nope_layer_interval
  attention_chunk_size, use_qk_norm, attn_temperature_tuning, floor_scale, attn_scale -> llama4.*
  rope_parameters {rope_type: llama3, ...} -> rope_scaling (type llama3)
Tensor names: HF's minus "model.", with the decoder layer's `feed_forward` as our `mlp`. Experts
are stored fused in HF's layout (experts.gate_up_proj [E, H, 2I], experts.down_proj [E, I, H]).

The published repos (meta-llama/Llama-4-Scout-17B-16E, -Maverick-17B-128E) are
Llama4ForConditionalGeneration (model_type "llama4"): the text config is nested in `text_config`,
text tensors are named `language_model.model.*` / `language_model.lm_head.weight`, and there is a
vision tower. The `llama4` family reads such a directory as a `llama4_text` ArchConfig: the
`language_model.` prefix is stripped on load and vision / projector tensors are ignored, so
`model.hf_checkpoint=/dir` alone works; saving writes a text-only Llama4ForCausalLM checkpoint.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, Tensors, common_arch_kwargs, common_hf_config, register, rope_theta_of, rope_type_of

_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
_TEXT_PREFIX = "language_model."


def _problems(arch) -> list[str]:
    if arch.family == "llama4":
        return ["family llama4 is the multimodal checkpoint format; Llama 4 configs use family llama4_text "
                "(loading a llama4 checkpoint yields one)"]
    out = []
    if arch.llama4 is None:
        out.append("family llama4_text needs the llama4 block (chunked attention / NoPE layers)")
    if arch.qk_norm:
        out.append("family llama4_text: set qk_norm: false (Llama 4's q/k norm is llama4.use_qk_norm, an L2 norm)")
    if arch.mla or arch.dsa or arch.linear_attn or arch.mtp_layers:
        out.append("family llama4_text: remove the mla / dsa / linear_attn blocks and mtp_layers")
    if arch.partial_rotary_factor != 1.0:
        out.append("family llama4_text: partial_rotary_factor must be 1.0")
    if arch.rope_scaling is not None and arch.rope_scaling.type != "llama3":
        out.append(f"family llama4_text: rope_scaling.type must be llama3 (got {arch.rope_scaling.type!r})")
    if arch.llama4 is not None and arch.llama4.nope_layer_interval < 1:
        out.append("llama4.nope_layer_interval must be >= 1")
    moe = arch.moe
    if moe is not None:
        # What HF's Llama4TextMoe can express: sigmoid of the raw chosen logits, no renormalisation
        # or bias or groups, exactly one ungated shared expert as wide as a routed one.
        if (moe.scoring, moe.norm_topk_prob, moe.routed_scaling_factor, moe.score_correction_bias,
                moe.n_group, moe.shared_expert_gate) != ("sigmoid", False, 1.0, False, 1, False):
            out.append("family llama4_text: moe needs scoring: sigmoid, norm_topk_prob: false, routed_scaling_factor: "
                       "1.0, score_correction_bias: false, n_group: 1, shared_expert_gate: false")
        if moe.num_shared_experts != 1 or moe.shared_expert_intermediate_size not in (0, moe.moe_intermediate_size):
            out.append("family llama4_text: moe needs num_shared_experts: 1 with the routed experts' width "
                       "(shared_expert_intermediate_size 0 or moe_intermediate_size)")
    return out


def _moe_layers(arch) -> list[int]:
    return [i for i in range(arch.num_layers) if arch.is_moe_layer(i)]


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig, Llama4AttnConfig, MoEConfig, RopeScalingConfig

    n = d["num_hidden_layers"]
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"llama4_text: hidden_act {d['hidden_act']!r} is not supported (silu only)")
    interval = d.get("no_rope_layer_interval", 4)
    no_rope = d.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    if list(no_rope[:n]) != [int((i + 1) % interval != 0) for i in range(n)]:
        raise ValueError(f"llama4_text: no_rope_layers {no_rope} is not every {interval}-th layer NoPE; "
                         "only the interval pattern is supported")
    chunk = d.get("attention_chunk_size", 8192)
    layer_types = d.get("layer_types")
    want_types = ["chunked_attention" if r and chunk is not None else "full_attention" for r in no_rope[:n]]
    if layer_types is not None and list(layer_types) != want_types:
        raise ValueError(f"llama4_text: layer_types {layer_types} differ from RoPE layers chunked, NoPE layers full")

    rope_type = rope_type_of(d)
    scaling = None
    if rope_type == "llama3":
        spec = d.get("rope_parameters") or {}
        if spec.get("rope_type", spec.get("type")) != "llama3":
            spec = d.get("rope_scaling") or {}
        scaling = RopeScalingConfig(
            type="llama3", factor=float(spec["factor"]),
            original_max_position_embeddings=int(spec["original_max_position_embeddings"]),
            low_freq_factor=float(spec["low_freq_factor"]), high_freq_factor=float(spec["high_freq_factor"]))
    elif rope_type != "default":
        raise ValueError(f"llama4_text: unsupported RoPE scaling type {rope_type!r} (default or llama3)")

    step = d.get("interleave_moe_layer_step", 1)
    moe_layers = d.get("moe_layers")
    moe_layers = list(range(step - 1, n, step)) if moe_layers is None else list(moe_layers)
    moe, mlp_only = None, []
    expert_width = d.get("intermediate_size", 8192)
    if moe_layers:
        if moe_layers == list(range(step - 1, n, step)):
            freq = step
        else:  # any other list: every layer MoE except the listed dense ones
            freq, mlp_only = 1, [i for i in range(n) if i not in moe_layers]
        moe = MoEConfig(
            num_experts=d.get("num_local_experts", 16), num_experts_per_tok=d.get("num_experts_per_tok", 1),
            moe_intermediate_size=expert_width, scoring="sigmoid", norm_topk_prob=False,
            num_shared_experts=1, shared_expert_intermediate_size=expert_width, layer_freq=freq)

    kwargs = common_arch_kwargs(d, default_head_dim=128)  # Llama4TextConfig defaults head_dim to 128
    kwargs.update(
        family="llama4_text",
        intermediate_size=d.get("intermediate_size_mlp", 16384),
        rope_theta=rope_theta_of(d, 500000.0),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=d.get("max_position_embeddings", 4096 * 32),
    )
    return ArchConfig(
        **kwargs,
        qk_norm=False,
        attention_bias=bool(d.get("attention_bias", False)),
        moe=moe,
        mlp_only_layers=mlp_only,
        rope_scaling=scaling,
        llama4=Llama4AttnConfig(
            attention_chunk_size=chunk, nope_layer_interval=interval,
            use_qk_norm=bool(d.get("use_qk_norm", True)),
            # Scout's config.json spells it 4 (truthy), the dataclass a bool.
            attn_temperature_tuning=bool(d.get("attn_temperature_tuning", True)),
            floor_scale=int(d.get("floor_scale", 8192)), attn_scale=float(d.get("attn_scale", 0.1))),
    )


def _from_hf_multimodal(d: dict[str, Any]):
    """A Llama4ForConditionalGeneration config.json: its nested text_config is the model we train."""
    text = dict(d.get("text_config") or {})
    if not text:
        raise ValueError("llama4: config.json has no text_config")
    text["model_type"] = "llama4_text"
    text.setdefault("tie_word_embeddings", d.get("tie_word_embeddings", False))
    return _from_hf(text)


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    l4, moe, n = arch.llama4, arch.moe, arch.num_layers
    out = common_hf_config(arch, dtype)
    expert_width = moe.moe_intermediate_size if moe is not None else arch.intermediate_size
    no_rope = [int(l4.uses_rope(i)) for i in range(n)]
    out.update(
        intermediate_size=expert_width,
        intermediate_size_mlp=arch.intermediate_size,
        num_local_experts=moe.num_experts if moe is not None else 1,
        num_experts_per_tok=moe.num_experts_per_tok if moe is not None else 1,
        moe_layers=_moe_layers(arch),  # explicit: covers layer_freq, first_k_dense and mlp_only_layers
        interleave_moe_layer_step=moe.layer_freq if moe is not None else 1,
        no_rope_layers=no_rope,
        no_rope_layer_interval=l4.nope_layer_interval,
        attention_chunk_size=l4.attention_chunk_size,
        layer_types=["chunked_attention" if r and l4.attention_chunk_size is not None else "full_attention"
                     for r in no_rope],
        use_qk_norm=l4.use_qk_norm,
        attn_temperature_tuning=l4.attn_temperature_tuning,
        floor_scale=l4.floor_scale,
        attn_scale=l4.attn_scale,
        attention_bias=arch.attention_bias,
        router_aux_loss_coef=0.001,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    s = arch.rope_scaling
    if s is not None:
        spec = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
        out["rope_parameters"] = {**spec, "rope_theta": arch.rope_theta}
        out["rope_scaling"] = spec  # transformers < 5
    return out


def _is_ignored(name: str, arch) -> bool:
    """Vision tower and projector of the multimodal checkpoints: not part of the text model."""
    return name.startswith(_VISION_PREFIXES)


def _strip_language_model(tensors: Tensors, arch) -> Tensors:
    """`language_model.model.x` / `language_model.lm_head.weight` (multimodal) -> `model.x` / `lm_head.weight`."""
    return {k[len(_TEXT_PREFIX):] if k.startswith(_TEXT_PREFIX) else k: v for k, v in tensors.items()}


_NOTES = ("iRoPE: chunked local attention + interleaved RoPE on 3 of 4 layers, NoPE global layers with "
          "temperature tuning; L2 qk-norm; llama3 RoPE scaling; top-1 sigmoid MoE scaling the expert input "
          "+ shared expert, interleaved dense layers")

register(Family("llama4_text", "Llama4ForCausalLM", _from_hf, _to_hf, _problems,
                renames=((r"\.mlp\.", ".feed_forward."),), renames_back=((r"\.feed_forward\.", ".mlp."),),
                from_hf_tensors=_strip_language_model, ignored=_is_ignored, notes=_NOTES))
# Only read: the published checkpoints; loading one yields a llama4_text ArchConfig (see above).
register(Family("llama4", "Llama4ForConditionalGeneration", _from_hf_multimodal, _to_hf, _problems,
                notes="Llama4ForConditionalGeneration checkpoints, loaded as llama4_text (text model only)"))
