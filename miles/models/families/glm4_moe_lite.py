"""GLM-4.7-Flash (HF `glm4_moe_lite`): DeepSeek-V3's MLA on GLM's MoE.

Same blocks as deepseek_v3 (`miles.models.mla` + the sigmoid/bias MoE with one shared expert and
group-limited top-k); differences are in config.json only: the dense layers are listed per layer
(`mlp_layer_types`, "dense" / "sparse"; older files give `first_k_dense_replace`), and the
latent norms keep eps 1e-6 while the decoder norms use rms_norm_eps (1e-5 in the release).
Checkpoints hold one MTP layer (index num_hidden_layers) in DeepSeek's layout, embedding / head
copies included (mtp_io.py). Tensor names equal HF's minus the leading "model."; experts are stored
one matrix per expert.
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, register
from miles.models.families.deepseek import (from_checkpoint, mla_moe_arch_kwargs, mla_moe_hf_config,
                                            mla_moe_problems, to_checkpoint)
from miles.models.families.mtp_io import ignored_layers


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig

    kwargs = mla_moe_arch_kwargs(d)
    n = d["num_hidden_layers"]
    kinds = d.get("mlp_layer_types") or ["dense"] * d.get("first_k_dense_replace", 1) + ["sparse"] * n
    dense = [i for i, kind in enumerate(kinds[:n]) if kind == "dense"]
    first_k = next((i for i in range(n) if i not in dense), n)  # leading dense layers
    kwargs["moe"].first_k_dense = first_k
    return ArchConfig(**kwargs, mlp_only_layers=[i for i in dense if i >= first_k])


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    out = mla_moe_hf_config(arch, dtype)
    kinds = ["sparse" if arch.is_moe_layer(i) else "dense" for i in range(arch.num_layers)]
    out.update(mlp_layer_types=kinds, first_k_dense_replace=arch.moe.first_k_dense)
    return out


register(Family(
    "glm4_moe_lite", "Glm4MoeLiteForCausalLM", _from_hf, _to_hf, mla_moe_problems,
    to_hf_tensors=to_checkpoint, from_hf_tensors=from_checkpoint, ignored=ignored_layers,
    notes="MLA (latent KV cache) + sigmoid/bias MoE with shared expert, dense layers by index, MTP layer",
))
