"""Weights between the project's names and Megatron-core's GPTModel: pure tensor code, no megatron import.

    mstate = to_megatron(state, arch)          # native (HF-named) tensors -> GPTModel.state_dict() names
    state = from_megatron(mstate, arch)        # and back, bitwise

Native names are HF's minus the leading "model." (what `miles.models.from_pretrained` loads and the
engines take in weight sync), experts fused as transformers 5 holds them: `experts.gate_up_proj`
[E, 2I, H] (gate rows, then up) and `experts.down_proj` [E, H, I]. Megatron's layouts:
- `linear_qkv` [(heads + 2 groups) * D, H]: per query group its heads' q rows, then its k, then its v
  (the same for the q/k/v biases of qwen2);
- `linear_fc1` [2I, H]: gate rows then up rows (SwiGLU), per dense MLP and per expert
  (`experts.local_experts.<e>`, the local spec's SequentialMLP);
- tied embeddings: no `output_layer.weight` (the output layer reads the embedding);
- MLA (MLASelfAttention): renames only, the row layouts are HF's: q_a_proj / q_b_proj (or q_proj)
  -> linear_q_down_proj / linear_q_up_proj (linear_q_proj), kv_a_proj_with_mqa ([latent | rope key])
  -> linear_kv_down_proj, kv_b_proj (per head [k_nope | v]) -> linear_kv_up_proj, the latent norms
  -> q_layernorm / kv_layernorm;
- DSA (DeepSeek-V3.2, GLM-5): the lightning indexer lives in the project's core attention, under its
  native names: `self_attn.indexer.<wq_b | wk | k_norm | weights_proj>` ->
  `self_attention.core_attention.indexer.<the same>` (layers that share a selection have none);
- DeepSeek MoE: the shared experts' SwiGLU as a dense MLP (`mlp.shared_experts.linear_fc1` [gate; up]),
  the router's correction bias `gate.e_score_correction_bias` -> `router.expert_bias`.
`te=True` names the norms as Transformer Engine's spec fuses them: the attention's input norm into
`linear_qkv.layer_norm_weight`, a dense MLP's pre-norm into `linear_fc1.layer_norm_weight`, and
MLA's latent norms into `linear_q_up_proj` / `linear_kv_up_proj`'s `layer_norm_weight`.
"""

from __future__ import annotations

import re

import torch

from miles.trainer.megatron.arch import moe_layer_pattern

Tensors = dict[str, torch.Tensor]


def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[heads*D, ...], [groups*D, ...] x2 -> [(heads + 2 groups) * D, ...], grouped per query group."""
    q, k, v = (t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _qkv_split(qkv: torch.Tensor, arch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // groups * d
    g = qkv.reshape(groups, per_group + 2 * d, *qkv.shape[1:])
    q, k, v = g.split([per_group, d, d], dim=1)
    return tuple(t.reshape(-1, *qkv.shape[1:]).contiguous() for t in (q, k, v))


_MLA_NAMES = {  # native self_attn.<name> -> Megatron self_attention.<name>, unfused spec / TE spec
    "q_proj.weight": ("linear_q_proj.weight",) * 2,
    "q_a_proj.weight": ("linear_q_down_proj.weight",) * 2,
    "q_a_layernorm.weight": ("q_layernorm.weight", "linear_q_up_proj.layer_norm_weight"),
    "q_b_proj.weight": ("linear_q_up_proj.weight",) * 2,
    "kv_a_proj_with_mqa.weight": ("linear_kv_down_proj.weight",) * 2,
    "kv_a_layernorm.weight": ("kv_layernorm.weight", "linear_kv_up_proj.layer_norm_weight"),
    "kv_b_proj.weight": ("linear_kv_up_proj.weight",) * 2,
}
# DSA's indexer (miles/models/dsa.py's LightningIndexer, held as it is by dsa_attention.DSACoreAttention)
_DSA_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def _layer_names(i: int, moe: bool, te: bool, mla: bool, dsa: bool = False) -> dict[str, str]:
    """Native -> Megatron names of layer i's unfused tensors."""
    n, m = f"layers.{i}.", f"decoder.layers.{i}."
    fused_input_norm = te and not mla  # TE's MLA spec keeps the input norm apart (the down projections are plain)
    out = {
        n + "input_layernorm.weight":
            m + ("self_attention.linear_qkv.layer_norm_weight" if fused_input_norm else "input_layernorm.weight"),
        n + "self_attn.o_proj.weight": m + "self_attention.linear_proj.weight",
        n + "post_attention_layernorm.weight":
            m + ("mlp.linear_fc1.layer_norm_weight" if te and not moe else "pre_mlp_layernorm.weight"),
        n + "mlp.down_proj.weight": m + "mlp.linear_fc2.weight",
        n + "mlp.gate.weight": m + "mlp.router.weight",
        n + "mlp.gate.e_score_correction_bias": m + "mlp.router.expert_bias",
        n + "mlp.shared_experts.down_proj.weight": m + "mlp.shared_experts.linear_fc2.weight",
    }
    if mla:  # its q_layernorm is the q latent's norm
        out.update({n + "self_attn." + native: m + "self_attention." + names[te]
                    for native, names in _MLA_NAMES.items()})
        if dsa:  # the same names on both sides, wherever the layer has an indexer
            out.update({n + "self_attn.indexer." + name: m + "self_attention.core_attention.indexer." + name
                        for name in _DSA_INDEXER})
    else:
        out.update({n + "self_attn.q_norm.weight": m + "self_attention.q_layernorm.weight",
                    n + "self_attn.k_norm.weight": m + "self_attention.k_layernorm.weight"})
    return out


def _gate_up(state: Tensors, prefix: str, take) -> torch.Tensor | None:
    """[gate; up] rows of the SwiGLU at `prefix` (its gate_proj / up_proj taken from state), or None."""
    if prefix + "gate_proj.weight" not in state:
        return None
    return torch.cat([take(prefix + "gate_proj.weight"), take(prefix + "up_proj.weight")])


def _gate_up_split(fc1: torch.Tensor, prefix: str) -> Tensors:
    gate, up = fc1.chunk(2)
    return {prefix + "gate_proj.weight": gate.contiguous(), prefix + "up_proj.weight": up.contiguous()}


def to_megatron(state: Tensors, arch, te: bool = False) -> Tensors:
    """Native tensors of `arch` -> GPTModel state-dict names and layouts (see the module docstring).
    Raises KeyError naming a native tensor that has no Megatron place."""
    state, out = dict(state), {}
    take = state.pop
    out["embedding.word_embeddings.weight"] = take("embed_tokens.weight")
    out["decoder.final_layernorm.weight"] = take("norm.weight")
    if not arch.tie_word_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    for i, moe in enumerate(moe_layer_pattern(arch)):
        n, m = f"layers.{i}.", f"decoder.layers.{i}."
        attn = n + "self_attn."
        for kind in ("weight", "bias") if arch.mla is None else ():
            if attn + f"q_proj.{kind}" in state:
                out[m + f"self_attention.linear_qkv.{kind}"] = _qkv_fuse(
                    take(attn + f"q_proj.{kind}"), take(attn + f"k_proj.{kind}"), take(attn + f"v_proj.{kind}"),
                    arch.num_kv_heads)
        if moe:
            gate_up, down = take(n + "mlp.experts.gate_up_proj"), take(n + "mlp.experts.down_proj")
            for e in range(gate_up.shape[0]):
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
            shared = _gate_up(state, n + "mlp.shared_experts.", take)
            if shared is not None:
                out[m + "mlp.shared_experts.linear_fc1.weight"] = shared
        else:
            out[m + "mlp.linear_fc1.weight"] = _gate_up(state, n + "mlp.", take)
        for native, mega in _layer_names(i, moe, te, arch.mla is not None, arch.dsa is not None).items():
            if native in state:
                out[mega] = take(native)
    if state:
        raise KeyError(f"no Megatron-core place for {sorted(state)[:4]} (family {arch.family})")
    return out


_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")


def from_megatron(mstate: Tensors, arch, te: bool = False) -> Tensors:
    """GPTModel state-dict tensors -> native names and layouts; the inverse of `to_megatron`.
    Megatron's bookkeeping entries (`_extra_state`) are skipped; an unknown tensor raises KeyError."""
    mstate = {k: v for k, v in mstate.items() if not k.endswith("._extra_state")}
    take = mstate.pop
    out = {"embed_tokens.weight": take("embedding.word_embeddings.weight"),
           "norm.weight": take("decoder.final_layernorm.weight")}
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")
    else:
        mstate.pop("output_layer.weight", None)  # a tied output layer, where a version lists it
    experts: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [k for k in mstate if _EXPERT.match(k)]:
        layer, e, kind = _EXPERT.match(name).groups()
        experts.setdefault(int(layer), {}).setdefault(kind, {})[int(e)] = take(name)
    for i, moe in enumerate(moe_layer_pattern(arch)):
        n, m = f"layers.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias") if arch.mla is None else ():
            fused = m + f"self_attention.linear_qkv.{kind}"
            if fused in mstate:
                q, k, v = _qkv_split(take(fused), arch)
                out.update({n + f"self_attn.q_proj.{kind}": q, n + f"self_attn.k_proj.{kind}": k,
                            n + f"self_attn.v_proj.{kind}": v})
        if moe:
            parts = experts.pop(i)
            count = len(parts["linear_fc1"])
            out[n + "mlp.experts.gate_up_proj"] = torch.stack([parts["linear_fc1"][e] for e in range(count)])
            out[n + "mlp.experts.down_proj"] = torch.stack([parts["linear_fc2"][e] for e in range(count)])
            if m + "mlp.shared_experts.linear_fc1.weight" in mstate:
                out.update(_gate_up_split(take(m + "mlp.shared_experts.linear_fc1.weight"), n + "mlp.shared_experts."))
        else:
            out.update(_gate_up_split(take(m + "mlp.linear_fc1.weight"), n + "mlp."))
        for native, mega in _layer_names(i, moe, te, arch.mla is not None, arch.dsa is not None).items():
            if mega in mstate:
                out[native] = take(mega)
    if mstate or experts:
        raise KeyError(f"no native place for {sorted(mstate)[:4] or sorted(experts)} (family {arch.family})")
    return out
