"""The trainer's side of LoRA (trainer.lora.rank > 0; docs/lora.md): adapters trained, base frozen.

    lora = attach(model, cfg.lora, precision, seed, recipe)   # base frozen (bf16 / quantized: see attach)
    weights, digest = adapter_weights(lora, "fp32")   # what weight sync carries: the adapters only
    save_adapter(lora, model, path)                   # PEFT format (+ the merged HF model: export_model)

The optimizer and the gradient clipping see only the adapters, so the frozen base has no gradient
and no AdamW state; under a bf16 recipe it is held in bf16 (no fp32 master copy: it never changes,
and the engine holds the same bf16 values). Under fp8 / int4_qat (QLoRA, miles/precision/qlora.py)
its quantized projections are held in the rollout's format, quantized once here: what the engine
holds, multiplied as the engine multiplies it. The adapters stay fp32 masters.

Several adapters (trainer.lora.adapters): each is saved in a PEFT directory of its own
(`adapter/<name>/`), clipped on its own (`clip_each_adapter`) and, in a step without samples of
it, left out of the optimizer step: each is trained as if it were the only one, on its own samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from miles.config.schema import DType, LoRACfg, PrecisionCfg
from miles.models import save_pretrained
from miles.models.frozen_experts import quantize_frozen_experts
from miles.models.lora import LoRA
from miles.models.lora_peft import load_peft, save_peft
from miles.precision import qlora
from miles.precision.recipe import Recipe
from miles.transport.checksum import checksum, to_dtype

ADAPTER_DIR = "adapter"  # beside the model in resume checkpoints and the final export


def attach(model: torch.nn.Module, cfg: LoRACfg, precision: PrecisionCfg, seed: int, recipe: Recipe,
           masters: bool = False) -> LoRA:
    """Freeze the base and hook the adapters onto it. QLoRA (fp8, int4_qat): the quantized projections
    and stacked MoE experts held in the rollout format, the rest fp32 as the recipe's masters (a fresh adapter then gives the
    recipe's log-probs exactly); a bf16 recipe: all of it in bf16, unless `masters` (true on-policy: the
    engine runs the fp32 masters under autocast, so the trainer keeps the frozen base as those masters)."""
    model.requires_grad_(False)
    if qlora.holds_quantized_base(recipe):
        qlora.quantize_frozen_base(model, recipe)
        quantize_frozen_experts(model, recipe)
    elif precision.train_dtype == DType.bf16 and not masters:
        model.to(torch.bfloat16)
    return LoRA(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, dtype=torch.float32, seed=seed,
                adapters=cfg.adapters)


def adapter_weights(lora: LoRA, rollout_dtype: str, device: torch.device | None = None):
    """(adapters in the engine's dtype, their checksum): on the host, or on `device` (in-process sync)."""
    weights = to_dtype(lora.tensors(), rollout_dtype)
    if device is not None:
        weights = {k: v.to(device) for k, v in weights.items()}
    return weights, checksum(weights)


def adapter_dirs(lora: LoRA, path) -> list[tuple[int, Path]]:
    """(adapter number, its PEFT directory) under `path`: `adapter/` for the one adapter of a run,
    `adapter/<name>/` for each of several."""
    root = Path(path) / ADAPTER_DIR
    if not lora.adapter_names:
        return [(0, root)]
    return [(k, root / name) for k, name in enumerate(lora.adapter_names)]


def save_adapter(lora: LoRA, model, path, dropout: float = 0.0) -> None:
    for k, where in adapter_dirs(lora, path):
        save_peft(lora, model.config, where, dropout=dropout, adapter=k)


def load_adapter(lora: LoRA, model, path) -> None:
    for k, where in adapter_dirs(lora, path):
        load_peft(lora, model.config, where, adapter=k)


def clip_each_adapter(lora: LoRA, clip: Callable[[list, float], torch.Tensor], max_norm: float,
                      present: set[int]) -> dict[str, torch.Tensor]:
    """Named adapters: each adapter's gradients clipped to `max_norm` on their own (`clip`: the
    trainer's clip over its ranks), so no adapter's step depends on another's gradient; an adapter
    with no sample in the step (not in `present`) then loses its (zero) gradient, so the optimizer
    skips it: no moment decay, no weight decay. Returns the norms before clipping, `grad_norm` (all
    adapters') and `grad_norm/<name>`."""
    norms = {}
    for k, name in enumerate(lora.adapter_names):
        params = lora.adapter_parameters(k)
        norms[f"grad_norm/{name}"] = clip(params, max_norm)  # every rank clips every adapter: a collective
        if k not in present:
            for p in params:
                p.grad = None
    return {"grad_norm": torch.stack(list(norms.values())).square().sum().sqrt(), **norms}


def export_model_state(lora: LoRA, state: dict[str, torch.Tensor], config, path,
                       dtype: torch.dtype = torch.float32) -> None:
    """export_model from the model's whole state dict (FSDP: gathered on rank 0, where the sharded
    model's own weights are DTensors that `lora.merged` cannot swap; QLoRA: the dequantized base,
    which the held codes cannot take back)."""
    from miles.models.hf_io import model_class

    merged = dict(state)
    if lora.num_adapters == 1:
        for i in range(len(lora.names)):
            key = lora.state_key(i)
            merged[key] = (merged[key].float() + lora.delta(i).detach().to(merged[key].device)).to(merged[key].dtype)
    with torch.device("meta"):  # the structure only; the merged tensors become its weights
        whole = model_class(config)(config)
    whole.load_state_dict(merged, assign=True)
    save_pretrained(whole, path, dtype=dtype)
    save_adapter(lora, whole, path)


def hold_reference(ref_model: torch.nn.Module, recipe: Recipe) -> None:
    """The KL reference (the base model) under QLoRA: quantized as the policy's base, the same
    numbers as the recipe's forward over its fp32 copy at a fraction of the memory."""
    if qlora.holds_quantized_base(recipe):
        qlora.quantize_frozen_base(ref_model, recipe)
        quantize_frozen_experts(ref_model, recipe)


def export_model(lora: LoRA, model, path, dtype: torch.dtype = torch.float32) -> None:
    """One adapter: the merged HF checkpoint (W + alpha / rank * B A, in `dtype`) at `path`.
    Several: the frozen base there (no set of weights holds them all). Either way each adapter in
    PEFT's format beside it (`path/adapter`, `path/adapter/<name>`); the model's own weights are
    left as they were. QLoRA: W is the dequantized base the run trained over (its state dict)."""
    if qlora.frozen_quant_linears(model):
        export_model_state(lora, model.state_dict(), model.config, path, dtype)
        return
    if lora.num_adapters == 1:
        with lora.merged():
            save_pretrained(model, path, dtype=dtype)
    else:
        save_pretrained(model, path, dtype=dtype)
    save_adapter(lora, model, path)
