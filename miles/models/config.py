"""Architecture description of every decoder-only model family Miles trains.

`ArchConfig` is the single source of truth the modules in `miles.models` are built from. Core
fields describe the transformer every family shares (embedding, RMSNorm pre-norm blocks, GQA
attention with RoPE, SwiGLU MLP); optional feature blocks switch on what a family adds:

  moe          routed experts (softmax / sigmoid+bias routers, group-limited top-k, shared experts,
               dense-first layers, interleaved MoE layers)
  mla          multi-head latent attention (DeepSeek-V3 / Kimi K2 / GLM-4.7-Flash / GLM-5)
  dsa          DeepSeek sparse attention: lightning indexer + top-k key selection (V3.2, GLM-5)
  linear_attn  gated DeltaNet layers interleaved with full attention (Qwen3-Next)
  rope_scaling YaRN / Llama-3 style frequency scaling
  llama4       chunked attention with NoPE layers (iRoPE), L2 q/k norm, attention temperature tuning

`family` is the HF `model_type` ("qwen3", "deepseek_v3", ...); `miles.models.families` holds, per
family, the conversion to and from `config.json` and the checkpoint tensor names. The same
dataclass is the Hydra schema of `conf/model/*.yaml` (`miles.config.schema.ModelCfg` extends it),
so every field here is a config key and every default is what an omitted key means.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional


@dataclass
class MoEConfig:
    num_experts: int = 8  # routed experts per MoE layer
    num_experts_per_tok: int = 2  # top-k routed experts per token
    moe_intermediate_size: int = 64  # SwiGLU width of one routed expert
    scoring: str = "softmax"  # router score: softmax (Qwen3-MoE, MiniMax...) or sigmoid (DeepSeek-V3, GLM)
    norm_topk_prob: bool = True  # renormalize the top-k weights to sum to 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weighted sum
    score_correction_bias: bool = False  # learned per-expert bias added for selection only (DeepSeek-V3)
    n_group: int = 1  # expert groups for group-limited routing (1: off)
    topk_group: int = 1  # groups a token may route to
    num_shared_experts: int = 0  # always-on experts (width shared_expert_intermediate_size each)
    shared_expert_intermediate_size: int = 0  # 0: moe_intermediate_size * num_shared_experts
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert output (Qwen2/3-Next style)
    first_k_dense: int = 0  # the first k layers use a dense MLP (intermediate_size)
    layer_freq: int = 1  # every layer_freq-th layer is MoE (Llama 4 interleave, Qwen3-MoE sparse step)

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense and (layer + 1) % self.layer_freq == 0


@dataclass
class MLAConfig:
    q_lora_rank: int = 0  # query compression rank (0: full-rank q_proj, as DeepSeek-V2-Lite)
    kv_lora_rank: int = 32  # compressed KV latent width (what the cache stores)
    qk_nope_head_dim: int = 16  # per-head q/k width without RoPE
    qk_rope_head_dim: int = 8  # per-head q/k width with RoPE (k part shared by all heads)
    v_head_dim: int = 16  # per-head value width
    # HF DeepseekV3 / Glm4MoeLite `rope_interleave`: the checkpoint's rope dims come in adjacent
    # pairs (x0, x1), (x2, x3)...; False: HF's rotate-half layout (j paired with j + dim/2).
    rope_interleave: bool = True  # rope pairs are adjacent dims (DeepSeek layout)


@dataclass
class DSAConfig:
    index_n_heads: int = 4  # lightning indexer heads
    index_head_dim: int = 16  # lightning indexer head width (its first qk_rope_head_dim dims rotate)
    index_topk: int = 8  # keys each query attends to
    # Layout of the indexer's rotary dims: False = rotate-half (DeepSeek-V3.2), True = adjacent
    # pairs (GLM-5). The main MLA attention has its own switch (mla.rope_interleave).
    rope_interleave: bool = False  # indexer rope pairs are adjacent dims (GLM-5 layout)
    # Layers without an indexer that reuse the top-k selection of the nearest earlier indexer
    # layer (GLM's cross-layer IndexShare, HF `indexer_types` == "shared"); empty: every layer indexes.
    shared_layers: List[int] = field(default_factory=list)  # layers reusing an earlier layer's top-k


@dataclass
class LinearAttnConfig:
    full_attention_interval: int = 4  # every k-th layer is full (gated) attention, the rest gated DeltaNet
    num_key_heads: int = 2  # DeltaNet key (and query) heads
    num_value_heads: int = 4  # DeltaNet value heads
    key_head_dim: int = 16  # DeltaNet key head width
    value_head_dim: int = 16  # DeltaNet value head width
    conv_kernel_size: int = 4  # causal depthwise conv over q/k/v

    def is_linear_layer(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0


@dataclass
class RopeScalingConfig:
    type: str = "yarn"  # yarn or llama3
    factor: float = 1.0  # context extension factor
    original_max_position_embeddings: int = 4096  # pre-extension context length
    beta_fast: float = 32.0  # yarn: high-frequency boundary (rotations)
    beta_slow: float = 1.0  # yarn: low-frequency boundary (rotations)
    # yarn attention factor (multiplies cos / sin) = mscale(factor, mscale) / mscale(factor, mscale_all_dim)
    # when both are set, else mscale(factor, 1); mscale(s, m) = 0.1 m ln(s) + 1 (transformers' rule).
    mscale: float = 0.0  # yarn: numerator coefficient of the attention factor (0: not set)
    mscale_all_dim: float = 0.0  # yarn: denominator coefficient, and DeepSeek's softmax-scale correction mscale(factor, mscale_all_dim)^2 (0: off)
    attention_factor: float = 0.0  # yarn: explicit attention factor (0: derived as above)
    truncate: bool = True  # yarn: round the correction range to whole dims (transformers' default)
    low_freq_factor: float = 1.0  # llama3: low-frequency wavelength factor
    high_freq_factor: float = 4.0  # llama3: high-frequency wavelength factor


@dataclass
class Llama4AttnConfig:
    # Chunks follow token positions (position // chunk), not padded columns, as in transformers.
    attention_chunk_size: Optional[int] = 8192  # RoPE layers attend within chunks of this many tokens (null: global)
    nope_layer_interval: int = 4  # every k-th layer has no RoPE and global attention (iRoPE)
    use_qk_norm: bool = True  # L2 norm (no weight) of q and k after RoPE, on RoPE layers only
    attn_temperature_tuning: bool = True  # NoPE-layer queries x (1 + attn_scale * log1p(floor((pos + 1) / floor_scale)))
    floor_scale: int = 8192  # temperature tuning: position bucket size
    attn_scale: float = 0.1  # temperature tuning: strength

    def uses_rope(self, layer: int) -> bool:
        """RoPE + chunked local attention, or (every nope_layer_interval-th layer) NoPE + global."""
        return (layer + 1) % self.nope_layer_interval != 0


@dataclass
class VisionConfig:
    """The vision tower of a vision-language family and its image tokens. The family picks the
    tower (miles.models.vlm.TOWERS): Qwen2.5-VL's windowed ViT (window_size, fullatt_block_indexes),
    Qwen3-VL's (num_position_embeddings, deepstack_visual_indexes) or GLM-4.5V's
    (num_position_embeddings, norm_eps); a field another tower has no use for keeps its default."""
    depth: int = 2  # ViT blocks
    hidden_size: int = 32  # ViT width
    intermediate_size: int = 64  # ViT MLP width (GLM-4.5V: its merger's; its blocks' MLP is out_hidden_size wide)
    num_heads: int = 2  # ViT attention heads
    out_hidden_size: int = 64  # patch merger output = the decoder's hidden_size
    in_channels: int = 3  # image channels
    patch_size: int = 14  # square patch side in pixels
    temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
    spatial_merge_size: int = 2  # m x m neighbouring patches merge into one decoder token
    window_size: int = 112  # window attention side in pixels (Qwen2.5-VL)
    fullatt_block_indexes: List[int] = field(default_factory=list)  # blocks with full (not windowed) attention
    rope_theta: float = 10000.0  # base of the ViT's 2-D rotary embedding
    image_token_id: int = 151655  # placeholder token each merged image patch replaces
    video_token_id: int = 151656  # placeholder token of video patches
    vision_start_token_id: int = 151652  # token opening an image span
    vision_end_token_id: int = 151653  # token closing an image span
    tokens_per_second: int = 2  # Qwen2.5-VL: mRoPE temporal positions per second of video
    # GLM-4.5V writes a video's frames with the image token between these two (ids from config.json;
    # None: no video spans, every image token is an image's).
    video_start_token_id: Optional[int] = None  # token opening a video span (GLM-4.5V)
    video_end_token_id: Optional[int] = None  # token closing a video span (GLM-4.5V)
    # A learned square grid of position embeddings, resampled to each image's patch grid (Qwen3-VL:
    # bilinear, GLM-4.5V: bicubic); 0: none (Qwen2.5-VL, whose ViT has rotary positions only).
    num_position_embeddings: int = 0  # entries of the learned ViT position grid (a square number)
    # DeepStack (Qwen3-VL): the merged features after these ViT blocks are added to the image tokens'
    # hidden states after decoder layers 0, 1, ... (one decoder layer per listed block).
    deepstack_visual_indexes: List[int] = field(default_factory=list)  # ViT blocks feeding DeepStack
    norm_eps: float = 1e-6  # ViT RMSNorm epsilon of GLM-4.5V (rms_norm_eps); the Qwen towers fix 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class ArchConfig:
    vocab_size: int = 0
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    qk_norm: bool = True
    # head: RMSNorm per head over head_dim (Qwen3, GLM-4.5); full: one RMSNorm over all heads' q
    # (resp. k) together, weight [heads * head_dim] (MiniMax-M2's per-layer qk norm).
    qk_norm_type: str = "head"
    attention_bias: bool = False
    family: str = "qwen3"
    partial_rotary_factor: float = 1.0
    # Multi-token-prediction depths (miles.models.mtp): the families whose checkpoints carry them
    # (DeepSeek-V3 / V3.2, GLM-4.5+ / GLM-5, Qwen3-Next); 0 skips them on load.
    mtp_layers: int = 0
    moe: Optional[MoEConfig] = None
    mla: Optional[MLAConfig] = None
    dsa: Optional[DSAConfig] = None
    linear_attn: Optional[LinearAttnConfig] = None
    rope_scaling: Optional[RopeScalingConfig] = None
    llama4: Optional[Llama4AttnConfig] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    # Layer indices that keep a dense MLP although `moe` is set (Qwen3-MoE's mlp_only_layers).
    mlp_only_layers: List[int] = field(default_factory=list)
    # Vision-language families: the vision tower, and mRoPE's split of the rotary frequencies into
    # temporal / height / width sections (sums to rotary_dim / 2; empty: plain 1-D RoPE).
    vision: Optional[VisionConfig] = None
    mrope_section: List[int] = field(default_factory=list)
    # Qwen3-VL interleaves the axes over the frequencies (t, h, w, t, h, w, ...; the sections count
    # each axis' share) where Qwen2.5-VL and GLM-4.5V give each axis one consecutive block.
    mrope_interleaved: bool = False

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> list[str]:
        """Every inconsistency of this architecture, each naming the field to change (empty: fine).
        `validate()` reports them as config errors; constructing a bad ArchConfig raises them."""
        from miles.models.families import FAMILIES

        out = []
        if self.family not in FAMILIES:
            return [f"family: unknown model family {self.family!r}; choose one of {', '.join(sorted(FAMILIES))}"]
        if self.mla is None and self.num_heads % self.num_kv_heads:
            out.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.qk_norm_type not in ("head", "full"):
            out.append(f"qk_norm_type must be head or full, got {self.qk_norm_type!r}")
        if self.mla is None and self.rotary_dim % 2:
            out.append(f"the rotary width (head_dim x partial_rotary_factor = {self.rotary_dim}) must be even")
        if self.mrope_section and 2 * sum(self.mrope_section) != self.rotary_dim:
            out.append(f"mrope_section {self.mrope_section} must sum to rotary_dim / 2 = {self.rotary_dim // 2}")
        if self.mtp_layers < 0:
            out.append(f"mtp_layers must be >= 0, got {self.mtp_layers}")
        return out + FAMILIES[self.family].problems(self)

    @property
    def rotary_dim(self) -> int:
        """Per-head width that RoPE rotates (the rest of the head passes through)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def model_type(self) -> str:
        """HF model_type of this architecture (the family name)."""
        return self.family

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.mlp_only_layers and self.moe.is_moe_layer(layer)

    def to_hf_config(self, dtype: str = "float32") -> dict[str, Any]:
        """config.json dict that `transformers` loads as this family's *ForCausalLM.
        `dtype` is the storage dtype name of the weights ("float32", "bfloat16", ...)."""
        from miles.models.families import get_family

        return get_family(self.family).to_hf_config(self, dtype)


def from_hf_config(d: dict[str, Any]) -> ArchConfig:
    """Read a checkpoint's `config.json` dict into an ArchConfig.

    Raises ValueError naming the model_type when no family implements it, and for features a
    family does not have (e.g. sliding-window attention).
    """
    from miles.models.families import get_family

    return get_family(d.get("model_type")).from_hf_config(d)
