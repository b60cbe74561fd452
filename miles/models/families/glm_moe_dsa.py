"""GLM-5 (HF `glm_moe_dsa`): MLA + DeepSeek Sparse Attention + DeepSeek-style MoE, i.e. the
DeepSeek-V3.2 architecture (see deepseek_v32.py) with two differences:

  * the lightning indexer's rotary dims use adjacent pairs (interleaved), like the main MLA;
  * cross-layer index sharing: `indexer_types` (per layer "full" / "shared") lets a layer reuse
    the top-k selection of the previous full layer instead of running its own indexer (it then
    has no indexer tensors). transformers derives the list from `index_topk_pattern` ("FSS...")
    or from `index_topk_freq` / `index_skip_topk_offset` when absent; we read all three spellings
    into `dsa.shared_layers` and write the explicit list.

Defaults follow transformers' GlmMoeDsaConfig (its docstring names zai-org/GLM-5), e.g. no expert
groups (n_group 1) and rms_norm_eps 1e-5. Tensor names equal HF's minus "model."; experts per
expert on disk (moe_io); MTP layers as DeepSeek's (mtp_io.py), without the embedding / head copies,
which GLM-5's release leaves out; the MTP block has its own indexer (it is never a shared layer).
"""

from __future__ import annotations

from typing import Any

from miles.models.families import Family, register
from miles.models.families.deepseek import from_checkpoint, to_checkpoint
from miles.models.families.deepseek_v32 import dsa_arch_kwargs, dsa_hf_config, dsa_problems
from miles.models.families.mtp_io import ignored_layers

# transformers' GlmMoeDsaConfig defaults for keys a config.json may omit
_DEFAULTS = dict(n_group=1, topk_group=1, rms_norm_eps=1e-5, index_n_heads=32, index_head_dim=128,
                 index_topk=2048, first_k_dense_replace=3, routed_scaling_factor=2.5)


def indexer_types_from_hf(d: dict[str, Any]) -> list[str]:
    """Per-layer "full" / "shared", exactly as transformers' GlmMoeDsaConfig derives it."""
    if d.get("indexer_types"):
        return list(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(d["num_hidden_layers"])]


def _from_hf(d: dict[str, Any]):
    from miles.models.config import ArchConfig

    d = {**_DEFAULTS, **d}
    shared = [i for i, kind in enumerate(indexer_types_from_hf(d)) if kind == "shared"]
    return ArchConfig(**dsa_arch_kwargs(d, "glm_moe_dsa", rope_interleave=True, shared_layers=shared))


def _to_hf(arch, dtype: str) -> dict[str, Any]:
    out = dsa_hf_config(arch, dtype)
    shared = set(arch.dsa.shared_layers)
    out["indexer_types"] = ["shared" if i in shared else "full" for i in range(arch.num_layers)]
    return out


NOTES = ("GLM-5: MLA + DSA (lightning indexer, interleaved RoPE, optional cross-layer index sharing) + "
         "sigmoid+bias MoE with shared expert and dense-first layers, MTP layers")

register(Family(
    "glm_moe_dsa", "GlmMoeDsaForCausalLM", _from_hf, _to_hf, lambda arch: dsa_problems(arch, rope_interleave=True),
    to_hf_tensors=lambda t, arch: to_checkpoint(t, arch, mtp_copies=False),
    from_hf_tensors=from_checkpoint, ignored=ignored_layers, notes=NOTES,
))
