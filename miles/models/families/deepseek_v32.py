"""DeepSeek-V3.2 (HF `deepseek_v32`): DeepSeek-V3 (MLA + DeepSeek MoE, see deepseek.py) with
DeepSeek Sparse Attention on every layer: a lightning indexer picks `index_topk` keys per query
(`miles.models.dsa`).

config.json adds `index_n_heads`, `index_head_dim`, `index_topk` to V3's keys; the indexer's rotary
dims use the rotate-half layout (the main MLA keeps V3's adjacent pairs). transformers 5 may also
write `mlp_layer_types` (per layer "dense" / "sparse"); the leading dense run is
moe.first_k_dense, any other dense layer goes to mlp_only_layers.

Tensor names equal HF's minus "model."; the indexer's are `self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}`; routed experts are fused in memory and one tensor per expert on disk (moe_io);
MTP layers as V3's (mtp_io.py: decoder layers from num_hidden_layers on, embedding / head copies
written as in V3's release; the MTP block has its own indexer). The released weights are FP8 with
block scales (`*_scale_inv`): the loader reads plain floating-point tensors only.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, register
from miles.models.families.deepseek import (from_checkpoint, mla_moe_arch_kwargs, mla_moe_hf_config,
                                            mla_moe_problems, to_checkpoint)
from miles.models.families.mtp_io import ignored_layers


def dense_layers_from_hf(d: dict[str, Any]) -> tuple[int, list[int]]:
    """(first_k_dense, other dense layers) from `mlp_layer_types` or `first_k_dense_replace`."""
    types = d.get("mlp_layer_types")
    if not types:
        return min(d.get("first_k_dense_replace", 3), d["num_hidden_layers"]), []
    first = next((i for i, kind in enumerate(types) if kind != "dense"), len(types))
    return first, [i for i, kind in enumerate(types) if kind == "dense" and i >= first]


def dsa_arch_kwargs(d: dict[str, Any], family: str, rope_interleave: bool, shared_layers: list[int]):
    """ArchConfig kwargs of an MLA + DSA + MoE config.json (deepseek_v32, glm_moe_dsa)."""
    from miles.models.config import DSAConfig

    kwargs = mla_moe_arch_kwargs(d)
    kwargs["family"] = family
    kwargs["moe"].first_k_dense, kwargs["mlp_only_layers"] = dense_layers_from_hf(d)
    kwargs["dsa"] = DSAConfig(index_n_heads=d["index_n_heads"], index_head_dim=d["index_head_dim"],
                              index_topk=d["index_topk"], rope_interleave=rope_interleave,
                              shared_layers=shared_layers)
    return kwargs


def dsa_hf_config(arch, dtype: str) -> dict[str, Any]:
    """config.json of an MLA + DSA + MoE arch (the keys deepseek_v32 and glm_moe_dsa share)."""
    out = mla_moe_hf_config(arch, dtype)
    for key in ("rope_interleave", "topk_method"):  # V3 keys these strict configs do not declare
        out.pop(key, None)
    n = arch.num_layers
    dense = set(range(min(arch.moe.first_k_dense, n))) | set(arch.mlp_only_layers)
    out.update(
        first_k_dense_replace=arch.moe.first_k_dense,
        mlp_layer_types=["dense" if i in dense else "sparse" for i in range(n)],
        index_n_heads=arch.dsa.index_n_heads, index_head_dim=arch.dsa.index_head_dim,
        index_topk=arch.dsa.index_topk,
    )
    return out


def dsa_problems(arch, rope_interleave: bool) -> list[str]:
    """What HF's DSA families (and our implementation of them) can represent."""
    name = arch.family
    # mla_moe_problems refuses any dsa block (it speaks for the dense-MLA families): drop that line
    # and check the other blocks it covered here.
    out = [p for p in mla_moe_problems(arch) if "remove the dsa" not in p]
    if arch.linear_attn or arch.llama4:
        out.append(f"family {name}: remove the linear_attn / llama4 blocks")
    if arch.dsa is None or arch.mla is None:
        return out + [f"family {name} needs a dsa block (DeepSeek sparse attention) on top of mla"]
    d, m = arch.dsa, arch.mla
    if m.q_lora_rank <= 0:
        out.append(f"family {name}: mla.q_lora_rank must be > 0 (the indexer reads the q latent)")
    if not m.rope_interleave:
        out.append(f"family {name}: mla.rope_interleave must be true (transformers always interleaves here)")
    if d.rope_interleave != rope_interleave:
        out.append(f"family {name}: dsa.rope_interleave must be {str(rope_interleave).lower()}")
    if d.index_head_dim < m.qk_rope_head_dim:
        out.append(f"family {name}: dsa.index_head_dim must be >= mla.qk_rope_head_dim ({m.qk_rope_head_dim})")
    if d.index_n_heads < 1 or d.index_topk < 1:
        out.append(f"family {name}: dsa.index_n_heads and dsa.index_topk must be >= 1")
    if any(not 0 <= i < arch.num_layers for i in d.shared_layers) or 0 in d.shared_layers:
        out.append(f"family {name}: dsa.shared_layers must be layer indices in [1, num_layers) "
                   "(layer 0 has no earlier indexer to share)")
    return out


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig

    if (d.get("rope_interleave") is False):
        raise ValueError("deepseek_v32: rope_interleave=false is not supported (transformers interleaves)")
    return ArchConfig(**dsa_arch_kwargs(d, "deepseek_v32", rope_interleave=False, shared_layers=[]))


def _problems(arch) -> list[str]:
    out = dsa_problems(arch, rope_interleave=False)
    if arch.dsa is not None and arch.dsa.shared_layers:
        out.append("family deepseek_v32: every layer has its own indexer; clear dsa.shared_layers")
    return out


NOTES = ("DeepSeek-V3 (MLA, YaRN, sigmoid+bias group-limited MoE, shared expert, dense-first, MTP) + DSA: "
         "lightning indexer (rotate-half RoPE) selecting index_topk keys per query, indexer key cache")

register(Family(
    "deepseek_v32", "DeepseekV32ForCausalLM", _from_hf, dsa_hf_config, _problems,
    to_hf_tensors=to_checkpoint, from_hf_tensors=from_checkpoint, ignored=ignored_layers, notes=NOTES,
))
