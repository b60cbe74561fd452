"""MTP modules between our names and the DeepSeek-V3 checkpoint layout, which deepseek_v3,
deepseek_v32, glm4_moe, glm4_moe_lite and glm_moe_dsa share (Qwen3-Next's `mtp.*` layout is a
static rename, in qwen3_next.py).

MTP depth j is checkpoint decoder layer L + j, L = num_hidden_layers:
  model.layers.{L+j}.enorm / hnorm / eh_proj                 <-> model.mtp.{j}.enorm / hnorm / eh_proj
  model.layers.{L+j}.shared_head.norm                        <-> model.mtp.{j}.norm
  model.layers.{L+j}.<self_attn, mlp, *_layernorm>          <-> model.mtp.{j}.block.<the same>
  model.layers.{L+j}.embed_tokens, .shared_head.head         copies of model.embed_tokens / lm_head
("model.mtp..." is what `Family.to_hf_name` makes of our `mtp...` names; experts are split or fused
by moe_io on either side.) DeepSeek-V3 / R1, GLM-4.5 and GLM-4.7-Flash checkpoints store the two
copies, GLM-4.6 and GLM-5 ones do not. We share the main tensors, so on load a copy is optional and
must equal its main tensor (a different one would silently change the MTP); on save a family writes
them where its published layout has them, for engines whose MTP loaders read them (vLLM did for
GLM before its PR 27597).
"""

from __future__ import annotations

import re

import torch

Tensors = dict[str, torch.Tensor]

_OURS = re.compile(r"^model\.mtp\.(\d+)\.(.+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
_COPIES = {"embed_tokens.weight": _EMBED, "shared_head.head.weight": _HEAD}


def ignored_layers(name: str, arch) -> bool:
    """Checkpoint decoder layers past the main ones and the MTP depths we build (all MTP layers of a
    checkpoint loaded with mtp_layers: 0)."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= arch.num_layers + arch.mtp_layers


def to_published(tensors: Tensors, arch, copies: bool) -> Tensors:
    """Our MTP tensors under their checkpoint names (+ the copies when `copies`, from the main
    tensors present in `tensors`: cloned, as safetensors refuses two names on one storage)."""
    out = {}
    for name, tensor in tensors.items():
        m = _OURS.match(name)
        if m is None:
            out[name] = tensor
            continue
        out[f"model.layers.{arch.num_layers + int(m.group(1))}.{_published_suffix(m.group(2))}"] = tensor
    if copies:
        head = _HEAD if _HEAD in tensors else _EMBED  # a tied head is the embedding
        for copy, main in (("embed_tokens.weight", _EMBED), ("shared_head.head.weight", head)):
            if main in tensors:
                for depth in range(arch.mtp_layers):
                    out[f"model.layers.{arch.num_layers + depth}.{copy}"] = tensors[main].clone()
    return out


def _published_suffix(ours: str) -> str:
    if ours.startswith("block."):
        return ours[len("block."):]
    return "shared_head." + ours if ours.startswith("norm.") else ours


def from_published(tensors: Tensors, arch) -> Tensors:
    """Checkpoint MTP layers -> our names; the copies are checked against the main tensors and dropped.
    Raises ValueError naming a copy that differs."""
    out = {}
    for name, tensor in tensors.items():
        m = _LAYER.match(name)
        depth = -1 if m is None else int(m.group(1)) - arch.num_layers
        if depth < 0:
            out[name] = tensor
            continue
        rest = m.group(2)
        if rest in _COPIES:
            main = _COPIES[rest] if _COPIES[rest] in tensors else _EMBED  # a tied head is the embedding
            if main in tensors and not torch.equal(tensors[main], tensor):
                raise ValueError(f"{name} differs from {main}: the MTP layers share the main model's embedding "
                                 "and LM head (as DeepSeek-V3's do), so a checkpoint whose MTP copy of them "
                                 "differs cannot be loaded")
            continue
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            out[f"model.mtp.{depth}.{rest}"] = tensor
        elif rest.startswith("shared_head.norm."):
            out[f"model.mtp.{depth}.{rest[len('shared_head.'):]}"] = tensor
        else:
            out[f"model.mtp.{depth}.block.{rest}"] = tensor
    return out
