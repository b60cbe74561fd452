"""Architecture description of the decoder-only models Miles trains (Qwen3 / Qwen2).

`ArchConfig` is the single source of truth the modules in `miles.models` are built
from. It is converted from and to the `config.json` dict of a HuggingFace checkpoint
(`from_hf_config` / `ArchConfig.to_hf_config`), so a checkpoint written by Miles loads
in `transformers` and vice versa.

The two supported families differ only in the attention block:
  * qwen3: RMSNorm over head_dim on q and k before RoPE (qk_norm), no projection bias;
  * qwen2: no qk_norm, bias on the q/k/v projections (never on o_proj).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2")


@dataclass
class ArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    qk_norm: bool = True
    attention_bias: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _ = self.model_type  # raises on a qk_norm / attention_bias combination we cannot express

    @property
    def model_type(self) -> str:
        """HF model_type this architecture corresponds to ("qwen3" or "qwen2")."""
        if self.qk_norm and not self.attention_bias:
            return "qwen3"
        if not self.qk_norm and self.attention_bias:
            return "qwen2"
        # HF Qwen3 with attention_bias also puts a bias on o_proj, and HF Qwen2 always has
        # q/k/v bias: other combinations have no transformers counterpart to stay in parity with.
        raise ValueError(
            f"unsupported combination qk_norm={self.qk_norm}, attention_bias={self.attention_bias}: "
            "use qk_norm=True/attention_bias=False (qwen3) or qk_norm=False/attention_bias=True (qwen2)"
        )

    def to_hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """config.json dict that `transformers` loads as Qwen3ForCausalLM (or Qwen2ForCausalLM).

        `dtype` is the storage dtype name of the weights ("float32", "bfloat16", ...).
        """
        model_type = self.model_type
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
        out: dict[str, Any] = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            # transformers < 5 reads rope_theta, >= 5 reads rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            # transformers < 5 reads torch_dtype, >= 5 reads dtype.
            "torch_dtype": dtype,
            "dtype": dtype,
        }
        if model_type == "qwen3":
            out["attention_bias"] = self.attention_bias
        return out


def _rope_theta(d: dict[str, Any]) -> float:
    """rope_theta sits at the top level (transformers < 5) or in rope_parameters (>= 5)."""
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for spec in (rope, scaling):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            raise ValueError(f"unsupported RoPE scaling type {kind!r} (only plain RoPE is implemented)")
    # 10000 is what transformers assumes for qwen2/qwen3 when the key is absent.
    return float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))


def from_hf_config(d: dict[str, Any]) -> ArchConfig:
    """Read a Qwen3 / Qwen2 `config.json` dict into an ArchConfig.

    Raises ValueError naming the model_type when it is not one of SUPPORTED_MODEL_TYPES,
    and for features this implementation does not have (RoPE scaling, sliding window).
    """
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if d.get("use_sliding_window"):
        raise ValueError(f"{model_type}: sliding-window attention is not supported")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    is_qwen3 = model_type == "qwen3"
    return ArchConfig(
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        # transformers' Qwen3Config defaults head_dim to 128, Qwen2 derives it from the width.
        head_dim=d.get("head_dim") or (128 if is_qwen3 else hidden // heads),
        rope_theta=_rope_theta(d),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=d.get("max_position_embeddings", 32768),
        qk_norm=is_qwen3,
        # Qwen2 always has q/k/v bias; Qwen3 makes it a config flag (off in released models).
        attention_bias=bool(d.get("attention_bias", False)) if is_qwen3 else True,
        bos_token_id=d.get("bos_token_id"),
        eos_token_id=d.get("eos_token_id"),
        pad_token_id=d.get("pad_token_id"),
    )
