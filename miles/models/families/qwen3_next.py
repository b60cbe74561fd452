"""Qwen3-Next: hybrid gated DeltaNet / gated full attention, high-sparsity MoE with a gated shared expert.

Layers i with (i + 1) % full_attention_interval != 0 are gated DeltaNet (`linear_attn.*`), the
others gated full attention (`self_attn.*`, q_proj twice as wide: query + output gate), see
`miles.models.deltanet`. All RMSNorms except the DeltaNet output norm are zero-centered
(y = x_hat * (1 + w)), which `blocks.make_norm` picks for this family. MoE: softmax router, top-k
renormalized, one shared expert scaled by sigmoid(shared_expert_gate(x)); `num_experts: 0` in
config.json means dense MLPs everywhere (transformers allows it; the tests use it too).
Tensor names equal HF's minus "model."; checkpoints store experts one by one
(`mlp.experts.{e}.gate_proj.weight` ...), converted to the MoE block's fused tensors on load.
MTP: real checkpoints carry one multi-token-prediction layer (`mtp.*`): `mtp.fc` (our eh_proj),
`mtp.pre_fc_norm_embedding` / `mtp.pre_fc_norm_hidden` (enorm / hnorm), `mtp.layers.0.*` (a gated
full-attention MoE layer) and `mtp.norm`, every norm zero-centered; embedding and LM head are the
main model's. The released config.json names no MTP count (vLLM's MTP model assumes 1): we read
`num_nextn_predict_layers` (vLLM's key, which we write) or `mtp_num_hidden_layers` (Qwen3.5's),
else 0, so loading the release with its MTP needs `"num_nextn_predict_layers": 1` added to its
config.json. With mtp_layers 0 the `mtp.*` tensors are skipped, as transformers does.
"""

from __future__ import annotations

import re
from typing import Any

from miles.models.families import Family, common_arch_kwargs, common_hf_config, register, rope_type_of
from miles.models.families.moe_io import fuse_experts, split_experts


def _interval_of(d: dict[str, Any]) -> int:
    """full_attention_interval from config.json; an explicit layer_types list must follow that pattern."""
    interval = int(d.get("full_attention_interval", 4))
    types = d.get("layer_types")
    if types:
        full = [i for i, kind in enumerate(types) if kind == "full_attention"]
        interval = full[0] + 1 if full else len(types) + 1
        want = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(len(types))]
        if list(types) != want:
            raise ValueError(f"qwen3_next: layer_types {types} is not a periodic full_attention_interval pattern")
    return interval


def _problems(arch) -> list[str]:
    out = []
    if arch.linear_attn is None:
        out.append("family qwen3_next needs the linear_attn block (gated DeltaNet layers)")
    if arch.mla or arch.dsa or arch.llama4:
        out.append("family qwen3_next: remove the mla / dsa / llama4 blocks")
    if not arch.qk_norm:
        out.append("family qwen3_next always has QK-norm: set qk_norm: true")
    if arch.rope_scaling is not None:
        out.append("family qwen3_next: RoPE scaling is not implemented for it")
    la = arch.linear_attn
    if arch.mtp_layers > 1:
        out.append("family qwen3_next: its checkpoint layout holds one MTP layer (mtp.fc, mtp.layers.0, ...): "
                   "mtp_layers must be 0 or 1")
    if la is not None and (la.num_value_heads % la.num_key_heads or la.full_attention_interval < 1):
        out.append("linear_attn.num_value_heads must be a multiple of num_key_heads and "
                   "full_attention_interval >= 1")
    m = arch.moe
    if m is not None:
        if m.scoring != "softmax" or m.score_correction_bias or m.n_group != 1 or m.routed_scaling_factor != 1.0:
            out.append("family qwen3_next: moe routing is softmax top-k (scoring: softmax, no correction bias, "
                       "n_group: 1, routed_scaling_factor: 1.0)")
        if m.num_shared_experts != 1 or not m.shared_expert_gate or m.shared_expert_intermediate_size <= 0:
            out.append("family qwen3_next: moe needs one sigmoid-gated shared expert (num_shared_experts: 1, "
                       "shared_expert_gate: true, shared_expert_intermediate_size > 0)")
        if m.first_k_dense:
            out.append("family qwen3_next: use mlp_only_layers instead of moe.first_k_dense")
    return out


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig, LinearAttnConfig, MoEConfig

    if rope_type_of(d) != "default":
        raise ValueError(f"qwen3_next: unsupported RoPE scaling type {rope_type_of(d)!r} (plain RoPE only)")
    rope = d.get("rope_parameters") or {}
    kwargs = common_arch_kwargs(d, default_head_dim=256)
    moe = None
    if d.get("num_experts", 512) > 0:
        shared = d.get("shared_expert_intermediate_size", 512)
        if not shared:
            raise ValueError("qwen3_next: shared_expert_intermediate_size 0 (no shared expert) is not supported")
        moe = MoEConfig(
            num_experts=d.get("num_experts", 512),
            num_experts_per_tok=d.get("num_experts_per_tok", 10),
            moe_intermediate_size=d.get("moe_intermediate_size", 512),
            scoring="softmax",
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            num_shared_experts=1,
            shared_expert_intermediate_size=shared,
            shared_expert_gate=True,
            layer_freq=d.get("decoder_sparse_step", 1),
        )
    return ArchConfig(
        **kwargs,
        qk_norm=True,
        attention_bias=bool(d.get("attention_bias", False)),
        # transformers < 5 keeps partial_rotary_factor at the top level, >= 5 in rope_parameters.
        partial_rotary_factor=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
        linear_attn=LinearAttnConfig(
            full_attention_interval=_interval_of(d),
            num_key_heads=d.get("linear_num_key_heads", 16),
            num_value_heads=d.get("linear_num_value_heads", 32),
            key_head_dim=d.get("linear_key_head_dim", 128),
            value_head_dim=d.get("linear_value_head_dim", 128),
            conv_kernel_size=d.get("linear_conv_kernel_dim", 4),
        ),
        moe=moe,
        mlp_only_layers=list(d.get("mlp_only_layers") or []),
        mtp_layers=int(d.get("num_nextn_predict_layers", d.get("mtp_num_hidden_layers")) or 0),
    )


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    la, m = arch.linear_attn, arch.moe
    out = common_hf_config(arch, dtype)
    out["rope_parameters"]["partial_rotary_factor"] = arch.partial_rotary_factor
    out.update(
        partial_rotary_factor=arch.partial_rotary_factor,
        attention_bias=arch.attention_bias,
        full_attention_interval=la.full_attention_interval,
        layer_types=["linear_attention" if la.is_linear_layer(i) else "full_attention"
                     for i in range(arch.num_layers)],
        linear_num_key_heads=la.num_key_heads,
        linear_num_value_heads=la.num_value_heads,
        linear_key_head_dim=la.key_head_dim,
        linear_value_head_dim=la.value_head_dim,
        linear_conv_kernel_dim=la.conv_kernel_size,
        num_experts=0 if m is None else m.num_experts,
        num_experts_per_tok=10 if m is None else m.num_experts_per_tok,
        moe_intermediate_size=512 if m is None else m.moe_intermediate_size,
        shared_expert_intermediate_size=512 if m is None else m.shared_expert_intermediate_size,
        norm_topk_prob=True if m is None else m.norm_topk_prob,
        decoder_sparse_step=1 if m is None else m.layer_freq,
        mlp_only_layers=list(arch.mlp_only_layers),
        use_sliding_window=False,
        num_nextn_predict_layers=arch.mtp_layers,
    )
    return out


def _ignored(name: str, arch) -> bool:
    # The multi-token-prediction layer of real checkpoints, when not built.
    return name.startswith("mtp.") and arch.mtp_layers == 0


# ours (after the "model." prefix rule) -> the checkpoint's mtp.* names, and back
_MTP = (("enorm.", "pre_fc_norm_embedding."), ("hnorm.", "pre_fc_norm_hidden."), ("eh_proj.", "fc."),
        ("norm.", "norm."), ("block.", "layers.0."))
_RENAMES = tuple((rf"^model\.mtp\.0\.{re.escape(ours)}", f"mtp.{theirs}") for ours, theirs in _MTP)
_RENAMES_BACK = tuple((rf"^mtp\.{re.escape(theirs)}", f"model.mtp.0.{ours}") for ours, theirs in _MTP)

register(Family(
    "qwen3_next", "Qwen3NextForCausalLM", _from_hf, _to_hf, _problems,
    renames=_RENAMES, renames_back=_RENAMES_BACK,
    to_hf_tensors=lambda t, arch: split_experts(t),
    from_hf_tensors=lambda t, arch: fuse_experts(t),
    ignored=_ignored,
    notes="hybrid gated DeltaNet + gated attention (partial rotary 0.25, zero-centered QK-norm), "
          "softmax top-k MoE + sigmoid-gated shared expert, MTP layer",
))
