"""Qwen3 and Qwen2 / Qwen2.5 dense models: one implementation, two attention variants.

  qwen3: RMSNorm over head_dim on q and k before RoPE (qk_norm), no projection bias;
  qwen2: no qk_norm, bias on the q/k/v projections (never on o_proj).
Tensor names equal HF's minus the leading "model.".
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, common_arch_kwargs, common_hf_config, register, rope_type_of


def _problems(arch) -> list[str]:
    if arch.mtp_layers:
        return [f"family {arch.family} has no MTP modules (its checkpoints carry none): set mtp_layers: 0"]
    want = {"qwen3": (True, False), "qwen2": (False, True)}[arch.family]
    if (arch.qk_norm, arch.attention_bias) != want:
        # HF Qwen3 with attention_bias also puts a bias on o_proj, and HF Qwen2 always has q/k/v
        # bias: other combinations have no transformers counterpart to stay in parity with.
        return [f"family {arch.family} needs qk_norm={want[0]} and attention_bias={want[1]}"]
    if arch.moe or arch.mla or arch.dsa or arch.linear_attn or arch.llama4:
        return [f"family {arch.family} is dense GQA: remove the moe / mla / dsa / linear_attn / llama4 blocks"]
    if arch.rope_scaling is not None or arch.partial_rotary_factor != 1.0:
        return [f"family {arch.family}: RoPE scaling and partial rotary are not implemented for it"]
    return []


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig

    model_type = d["model_type"]
    if d.get("use_sliding_window"):
        raise ValueError(f"{model_type}: sliding-window attention is not supported")
    if rope_type_of(d) != "default":
        raise ValueError(f"{model_type}: unsupported RoPE scaling type {rope_type_of(d)!r} (plain RoPE only)")
    is_qwen3 = model_type == "qwen3"
    # transformers' Qwen3Config defaults head_dim to 128, Qwen2 derives it from the width.
    kwargs = common_arch_kwargs(d, default_head_dim=128 if is_qwen3 else None)
    return ArchConfig(
        **kwargs,
        qk_norm=is_qwen3,
        # Qwen2 always has q/k/v bias; Qwen3 makes it a config flag (off in released models).
        attention_bias=bool(d.get("attention_bias", False)) if is_qwen3 else True,
    )


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    out = common_hf_config(arch, dtype)
    out.update(use_sliding_window=False, sliding_window=None)
    if arch.family == "qwen3":
        out["attention_bias"] = arch.attention_bias
    return out


for _name, _arch in (("qwen3", "Qwen3ForCausalLM"), ("qwen2", "Qwen2ForCausalLM")):
    register(Family(_name, _arch, _from_hf, _to_hf, _problems,
                    notes="GQA, RoPE, RMSNorm, SwiGLU" + (", QK-norm" if _name == "qwen3" else ", q/k/v bias")))
