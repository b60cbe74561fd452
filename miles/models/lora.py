"""LoRA adapters over a CausalLM's decoder projections, the same module on the trainer and the engine.

    lora = LoRA(model, rank=8, alpha=16, target_modules=["q_proj", "v_proj"], seed=0)
    model(...)                # each targeted nn.Linear returns base(x) + alpha / rank * B(A(dropout(x)))
    lora.tensors()            # {"layers.0.self_attn.q_proj.lora_A.weight": [r, in], "...lora_B.weight": [out, r]}
    lora.load(tensors)        # in place (the engine's side of a weight sync)
    with lora.merged():       # W + alpha / rank * B @ A in the base weights, the adapters off:
        save_pretrained(model, out)                                  # the merged HF checkpoint

The math and the initialisation are PEFT's `lora.Linear` (A kaiming-uniform, B zero, so a fresh
adapter leaves the model's outputs bit for bit as they were); the PEFT file format is
miles/models/lora_peft.py. Why the project's own module and not PEFT's layers: PEFT wraps each
targeted nn.Linear in a new module, which renames its weight (`q_proj.weight` becomes
`q_proj.base_layer.weight`). Everything that moves the base weights keys on the native names: the
strict HF loader and saver, the engine's flat weight buffer whose parameters are views, the
checksums, FSDP's state gathering, the precision recipes. Here the adapters live outside the model
(a module of their own, reached by forward hooks), so the model's state dict, and all that code, do
not change, and the adapters travel, checksum and save as a dict of their own.

Targets: nn.Linear modules of the main decoder (`layers.*`; not the LM head, whose weight the
trainer's chunked loss reads directly, nor the MTP draft modules). An entry of `target_modules`
matches a module whose name equals it or ends with "." + it (PEFT's rule for a list: "q_proj"),
or that the entry matches whole as a regular expression ("layers\\.[0-3]\\..*_proj"). Stacked MoE
experts (one [E, out, in] tensor, not nn.Linear) are not adapted yet.
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

# Every projection of a dense Qwen / Llama-style decoder layer (attention and MLP).
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DECODER_PREFIX = "layers."


def _matches(name: str, entry: str) -> bool:
    if name == entry or name.endswith("." + entry):
        return True
    try:
        return re.fullmatch(entry, name) is not None
    except re.error:
        return False


def find_targets(model: nn.Module, target_modules) -> list[tuple[str, nn.Linear]]:
    """(name, module) of the decoder's nn.Linear modules that `target_modules` selects, in model order."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.startswith(DECODER_PREFIX)
            and any(_matches(name, entry) for entry in target_modules)]


def candidate_names(model: nn.Module) -> list[str]:
    """The distinct last components of the modules LoRA can adapt (for messages)."""
    return sorted({name.rpartition(".")[2] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and name.startswith(DECODER_PREFIX)})


class LoRA(nn.Module):
    """Adapters A [rank, in] and B [out, rank] for each targeted projection of `model`, applied by
    forward hooks. `dtype`: the adapters' (the trainer keeps them in fp32, the engine in its own).
    `seed`: A's initialisation without touching the global RNG. `zero`: A = 0 too (an engine's
    adapters before the first sync: the same outputs as B = 0, nothing drawn)."""

    def __init__(self, model: nn.Module, rank: int, alpha: float, dropout: float = 0.0,
                 target_modules=ALL_PROJECTIONS, dtype: torch.dtype | None = None, seed: int | None = None,
                 zero: bool = False):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0 (got {rank})")
        targets = find_targets(model, target_modules)
        if not targets:
            raise ValueError(f"trainer.lora.target_modules={list(target_modules)} matches no projection of the "
                             f"model; its decoder projections: {', '.join(candidate_names(model))}")
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.names = [name for name, _ in targets]
        self._linears = [m for _, m in targets]  # a plain list: not submodules, the model owns them
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True
        gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
        self.lora_A, self.lora_B = nn.ParameterList(), nn.ParameterList()
        for linear in self._linears:
            weight = linear.weight
            a = torch.zeros(rank, linear.in_features, dtype=torch.float32)
            if not zero:  # PEFT's default: kaiming-uniform A (drawn on the CPU: the same on every device)
                nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
            kind = dict(device=weight.device, dtype=dtype or weight.dtype)
            self.lora_A.append(nn.Parameter(a.to(**kind)))
            self.lora_B.append(nn.Parameter(torch.zeros(linear.out_features, rank, **kind)))
        for i, linear in enumerate(self._linears):
            linear.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def add_delta(module, args, out):
            if not self.enabled:
                return out
            x = args[0]
            a, b = self.lora_A[i], self.lora_B[i]
            if not torch.is_autocast_enabled(x.device.type):
                x = x.to(a.dtype)  # as PEFT: the input in the adapters' dtype, the sum in the output's
            return out + (F.linear(F.linear(self.dropout(x), a), b) * self.scaling).to(out.dtype)
        return add_delta

    # ------------------------------------------------------------------ tensors by name
    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapters under `<module>.lora_A.weight` / `<module>.lora_B.weight` (native module names)."""
        out = {}
        for name, a, b in zip(self.names, self.lora_A, self.lora_B):
            out[f"{name}.lora_A.weight"] = a
            out[f"{name}.lora_B.weight"] = b
        return out

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` (tensors()'s names and shapes, any dtype / device) into the adapters in place."""
        mine = self.tensors()
        missing, unexpected = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
        if missing or unexpected:
            raise ValueError(f"LoRA tensors do not match the adapters: missing {missing[:4]}, "
                             f"unexpected {unexpected[:4]} (rank / target_modules differ?)")
        for name, t in tensors.items():
            if t.shape != mine[name].shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)} != the adapter's {tuple(mine[name].shape)}")
            mine[name].copy_(t)

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ------------------------------------------------------------------ merge
    def delta(self, i: int) -> torch.Tensor:
        """alpha / rank * B @ A of adapter i, [out, in], in fp32."""
        return (self.lora_B[i].float() @ self.lora_A[i].float()) * self.scaling

    @contextlib.contextmanager
    def merged(self):
        """Inside: the base weights hold W + delta (in their dtype) and the hooks add nothing; after,
        the original weight tensors are put back (no subtraction, so nothing drifts)."""
        originals = [linear.weight.data for linear in self._linears]
        with torch.no_grad():
            for i, linear in enumerate(self._linears):
                w = linear.weight.data
                linear.weight.data = (w.float() + self.delta(i).to(w.device)).to(w.dtype)
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
            for linear, w in zip(self._linears, originals):
                linear.weight.data = w
