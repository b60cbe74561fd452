"""Parameter counts of an architecture, from the modules themselves.

The model is built on the meta device (no memory, no init), so the count is exactly what
`CausalLM` would hold, for any size, in well under a second. A block whose parameters are not
all used per token (MoE) reports how many of them a token leaves idle via `idle_params()`.
"""

from __future__ import annotations

import torch

from miles.models.config import ArchConfig


def param_count(arch: ArchConfig) -> tuple[int, int]:
    """(total, active per token) parameter counts, embeddings and LM head included; MTP modules,
    which only serve speculative decoding and extra training losses, are left out (as in the
    published figures)."""
    from miles.models.causal_lm import CausalLM

    with torch.device("meta"):
        model = CausalLM(arch)
    total = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("mtp"))
    idle = sum(m.idle_params() for name, m in model.named_modules()
               if hasattr(m, "idle_params") and not name.startswith("mtp"))
    return total, total - idle
