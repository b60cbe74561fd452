"""Expert tensors between our fused layout and checkpoints' per-expert layout (all MoE families).

In memory (ours and transformers 5): `<prefix>.experts.gate_up_proj` [E, 2I, H] (gate rows then
up rows) and `<prefix>.experts.down_proj` [E, H, I]. On disk, released checkpoints and what
transformers 5 `save_pretrained` writes: one matrix per expert,
`<prefix>.experts.<e>.{gate,up,down}_proj.weight` (Mixtral / MiniMax spell them w1, w3, w2).
`fuse_experts` accepts both layouts (fused tensors pass through); `split_experts` writes the
per-expert one, which every transformers version and every serving engine reads.
"""

from __future__ import annotations

import re
from collections import defaultdict

import torch

Tensors = dict[str, torch.Tensor]
SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")  # HF Qwen / DeepSeek / GLM spelling
MIXTRAL_NAMES = ("w1", "w3", "w2")  # Mixtral / MiniMax spelling (gate, up, down)


def fuse_experts(tensors: Tensors, names: tuple[str, str, str] = SWIGLU_NAMES) -> Tensors:
    """Stack `<p>.experts.<e>.<gate|up|down>.weight` into `<p>.experts.gate_up_proj` / `down_proj`.
    Names stay HF-style; every other tensor passes through. Raises ValueError if an expert set has
    gaps (e.g. a missing shard) instead of silently building a smaller layer."""
    gate, up, down = names
    pattern = re.compile(rf"^(.*\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight$")
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    out: Tensors = {}
    for name, tensor in tensors.items():
        m = pattern.match(name)
        if m:
            groups[m.group(1)][m.group(3)][int(m.group(2))] = tensor
        else:
            out[name] = tensor
    for prefix, parts in groups.items():
        count = max(max(p) for p in parts.values()) + 1
        for kind in (gate, up, down):
            if sorted(parts.get(kind, {})) != list(range(count)):
                raise ValueError(f"{prefix}: per-expert {kind} tensors incomplete "
                                 f"(have {sorted(parts.get(kind, {}))}, want 0..{count - 1})")
        stack = lambda kind: torch.stack([parts[kind][e] for e in range(count)])  # noqa: E731
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack(gate), stack(up)], dim=1)
        out[f"{prefix}.down_proj"] = stack(down)
    return out


def split_experts(tensors: Tensors, names: tuple[str, str, str] = SWIGLU_NAMES) -> Tensors:
    """Inverse of `fuse_experts`: `<p>.experts.gate_up_proj` [E, 2I, H] / `down_proj` [E, H, I]
    -> one contiguous [I, H] / [H, I] matrix per expert."""
    gate, up, down = names
    out: Tensors = {}
    for name, tensor in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            g, u = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{gate}.weight"] = g[e].contiguous()
                out[f"{prefix}.{e}.{up}.weight"] = u[e].contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{down}.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out
