"""The trainer's side of LoRA (trainer.lora.rank > 0; docs/lora.md): adapters trained, base frozen.

    lora = attach(model, cfg.lora, precision, seed)   # base frozen (and in bf16 under a bf16 recipe)
    weights, digest = adapter_weights(lora, "fp32")   # what weight sync carries: the adapters only
    save_adapter(lora, model, path)                   # PEFT format (+ the merged HF model: export_merged)

The optimizer and the gradient clipping see only the adapters, so the frozen base has no gradient
and no AdamW state; under a bf16 recipe it is held in bf16 (no fp32 master copy: it never changes,
and the engine holds the same bf16 values). The adapters stay fp32 masters.
"""

from __future__ import annotations

from pathlib import Path

import torch

from miles.config.schema import DType, LoRACfg, PrecisionCfg
from miles.models import save_pretrained
from miles.models.lora import LoRA
from miles.models.lora_peft import load_peft, save_peft
from miles.transport.checksum import checksum, to_dtype

ADAPTER_DIR = "adapter"  # beside the model in resume checkpoints and the final export


def attach(model: torch.nn.Module, cfg: LoRACfg, precision: PrecisionCfg, seed: int) -> LoRA:
    model.requires_grad_(False)
    if precision.train_dtype == DType.bf16:
        model.to(torch.bfloat16)
    return LoRA(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, dtype=torch.float32, seed=seed)


def adapter_weights(lora: LoRA, rollout_dtype: str, device: torch.device | None = None):
    """(adapters in the engine's dtype, their checksum): on the host, or on `device` (in-process sync)."""
    weights = to_dtype(lora.tensors(), rollout_dtype)
    if device is not None:
        weights = {k: v.to(device) for k, v in weights.items()}
    return weights, checksum(weights)


def save_adapter(lora: LoRA, model, path, dropout: float = 0.0) -> None:
    save_peft(lora, model.config, Path(path) / ADAPTER_DIR, dropout=dropout)


def load_adapter(lora: LoRA, model, path) -> None:
    load_peft(lora, model.config, Path(path) / ADAPTER_DIR)


def export_merged_state(lora: LoRA, state: dict[str, torch.Tensor], config, path,
                        dtype: torch.dtype = torch.float32) -> None:
    """export_merged from the model's whole state dict (FSDP: gathered on rank 0, where the sharded
    model's own weights are DTensors that `lora.merged` cannot swap)."""
    from miles.models import CausalLM

    merged = dict(state)
    for i, name in enumerate(lora.names):
        w = merged[f"{name}.weight"]
        merged[f"{name}.weight"] = (w.float() + lora.delta(i).detach().to(w.device)).to(w.dtype)
    with torch.device("meta"):  # the structure only; the merged tensors become its weights
        whole = CausalLM(config)
    whole.load_state_dict(merged, assign=True)
    save_pretrained(whole, path, dtype=dtype)
    save_peft(lora, config, Path(path) / ADAPTER_DIR)


def export_merged(lora: LoRA, model, path, dtype: torch.dtype = torch.float32) -> None:
    """The merged HF checkpoint (W + alpha / rank * B A, in `dtype`) at `path`, the adapter in
    `path/adapter` (PEFT format); the model's own weights are left as they were."""
    with lora.merged():
        save_pretrained(model, path, dtype=dtype)
    save_peft(lora, model.config, Path(path) / ADAPTER_DIR)
