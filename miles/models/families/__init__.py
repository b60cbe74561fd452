"""Model families: how each HF `model_type` maps to an ArchConfig and to checkpoint tensor names.

A family is the glue between `config.json` / safetensors names and the shared modules of
`miles.models`; the modules themselves are chosen by the ArchConfig's feature blocks
(`miles.models.blocks`). Registering a family is one `Family(...)` in its own module, imported
below, so every family is known wherever `miles.models` is.

Tensor names: our parameter names equal HF's minus the leading "model." unless a family lists
`renames` (regex pairs, ours -> HF) or converts tensors (`to_hf_tensors` / `from_hf_tensors`),
e.g. to split fused expert weights into the per-expert tensors HF checkpoints store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

Tensors = dict[str, torch.Tensor]


def _identity(tensors: Tensors, arch: Any) -> Tensors:
    return tensors


@dataclass(frozen=True)
class Family:
    name: str  # HF model_type
    hf_architecture: str  # config.json "architectures" entry, e.g. "Qwen3ForCausalLM"
    from_hf_config: Callable[[dict], Any]  # config.json dict -> ArchConfig
    to_hf_config: Callable[[Any, str], dict]  # (ArchConfig, dtype name) -> config.json dict
    problems: Callable[[Any], list[str]] = lambda arch: []  # family-specific ArchConfig checks
    # (our regex, HF replacement) and back; applied in order after the "model." prefix rule.
    renames: tuple[tuple[str, str], ...] = ()
    renames_back: tuple[tuple[str, str], ...] = ()
    # Whole-state conversions run on HF-named tensors (e.g. per-expert <-> fused experts).
    to_hf_tensors: Callable[[Tensors, Any], Tensors] = _identity
    from_hf_tensors: Callable[[Tensors, Any], Tensors] = _identity
    # Checkpoint tensors we knowingly do not load (e.g. MTP layers when mtp_layers == 0).
    ignored: Callable[[str, Any], bool] = lambda name, arch: False
    notes: str = ""  # one line for docs/models.md

    def to_hf_name(self, name: str) -> str:
        name = name if name.startswith("lm_head.") else "model." + name
        for pattern, repl in self.renames:
            name = re.sub(pattern, repl, name)
        return name

    def from_hf_name(self, name: str) -> str:
        for pattern, repl in self.renames_back:
            name = re.sub(pattern, repl, name)
        if name.startswith("model."):
            return name[len("model."):]
        if name.startswith("lm_head."):
            return name
        raise KeyError(f"no Miles name for checkpoint tensor {name!r}")


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def get_family(model_type: Optional[str]) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


def common_hf_config(arch: Any, dtype: str) -> dict[str, Any]:
    """The config.json keys every family shares (transformers 5 names, plus the < 5 spellings)."""
    return {
        "architectures": [get_family(arch.family).hf_architecture],
        "model_type": arch.family,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.rms_norm_eps,
        # transformers < 5 reads rope_theta, >= 5 reads rope_parameters.
        "rope_theta": arch.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": arch.rope_theta},
        "tie_word_embeddings": arch.tie_word_embeddings,
        "attention_dropout": 0.0,
        "use_cache": True,
        "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_id,
        "pad_token_id": arch.pad_token_id,
        # transformers < 5 reads torch_dtype, >= 5 reads dtype.
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def rope_theta_of(d: dict[str, Any], default: float = 10000.0) -> float:
    """rope_theta sits at the top level (transformers < 5) or in rope_parameters (>= 5)."""
    rope = d.get("rope_parameters") or {}
    return float(rope.get("rope_theta", d.get("rope_theta", default)))


def rope_type_of(d: dict[str, Any]) -> str:
    """The RoPE scaling type of a config.json ("default" when unscaled)."""
    for spec in (d.get("rope_parameters") or {}, d.get("rope_scaling") or {}):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            return kind
    return "default"


def common_arch_kwargs(d: dict[str, Any], default_head_dim: Optional[int] = None) -> dict[str, Any]:
    """ArchConfig keyword arguments for the fields every family's config.json spells alike."""
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    return dict(
        family=d["model_type"],
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or default_head_dim or hidden // heads,
        rope_theta=rope_theta_of(d),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )


# Each module registers its families on import.
from miles.models.families import qwen  # noqa: E402,F401
from miles.models.families import qwen3_moe  # noqa: E402,F401
from miles.models.families import glm4_moe  # noqa: E402,F401
from miles.models.families import minimax  # noqa: E402,F401
from miles.models.families import deepseek  # noqa: E402,F401
from miles.models.families import deepseek_v32  # noqa: E402,F401
from miles.models.families import glm_moe_dsa  # noqa: E402,F401
from miles.models.families import qwen3_next  # noqa: E402,F401
from miles.models.families import llama4  # noqa: E402,F401
from miles.models.families import glm4_moe_lite  # noqa: E402,F401
from miles.models.families import qwen2_5_vl  # noqa: E402,F401
from miles.models.families import qwen3_vl  # noqa: E402,F401
from miles.models.families import glm4v_moe  # noqa: E402,F401
