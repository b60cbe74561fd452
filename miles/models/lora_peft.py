"""LoRA adapters in PEFT's on-disk format: `adapter_config.json` + `adapter_model.safetensors`.

    save_peft(lora, model.config, "out/adapter")            # loadable by peft.PeftModel.from_pretrained
    load_peft(lora, model.config, "out/adapter")            # back into a LoRA of the same rank / targets
    save_peft(lora, model.config, "out/adapter/mul", adapter=1)   # several adapters: one directory each
    write_peft(synced, rank, alpha, arch, "dir")            # the same from a weight sync's tensors (an engine's side)

The tensors are named as PEFT names them on the transformers model, `base_model.model.<HF module>.
lora_A.weight` ([rank, in]) and `...lora_B.weight` ([out, rank]), the HF module name coming from the
family's own name mapping (miles/models/families). `target_modules` lists the adapted modules by
their full HF names, which PEFT matches exactly, so the adapter lands on the same modules however
the run selected them (names or regular expressions). Written without importing peft (not a
dependency of a run); tests/unit/models/test_lora_peft.py loads it with peft itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles.models.families import get_family
from miles.models.lora import LoRA

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def hf_module_names(lora: LoRA, arch) -> dict[str, str]:
    """native module name -> HF module name, for each adapted module."""
    return _hf_names(lora.names, arch)


def _hf_names(names, arch) -> dict[str, str]:
    family = get_family(arch.family)
    hf = {name: family.to_hf_name(name + ".weight").removesuffix(".weight") for name in names}
    if arch.vision is not None:
        # PEFT matches the modules of transformers' in-memory model, whose VLM classes hold the decoder
        # under model.language_model., whatever the checkpoint files say (Qwen2.5-VL's keep model.layers.).
        hf = {name: re.sub(r"^model\.(?!language_model\.)", "model.language_model.", h) for name, h in hf.items()}
    return hf


def save_peft(lora: LoRA, arch, path, dropout: float = 0.0, base_model: str | None = None, adapter: int = 0) -> None:
    """Adapter number `adapter` (in its own dtype) and PEFT's config for it, into the directory `path`."""
    write_peft(lora.tensors(adapter), lora.rank, lora.alpha, arch, path, dropout, base_model)


def write_peft(tensors: dict[str, torch.Tensor], rank: int, alpha: float, arch, path, dropout: float = 0.0,
               base_model: str | None = None) -> dict[str, str]:
    """save_peft from adapters by name (LoRA.tensors()'s names, e.g. what a weight sync carries), as
    they are. Returns {native name: the file's tensor name}."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    hf = _hf_names(sorted({name.partition(".lora_")[0] for name in tensors}), arch)
    keys, files = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.partition(".lora_")
        keys[name] = f"{PEFT_PREFIX}{hf[module]}.lora_{leaf}"
        files[keys[name]] = t.detach().to("cpu").contiguous()
    save_file(files, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(hf.values()),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return keys


def load_peft(lora: LoRA, arch, path, adapter: int = 0) -> None:
    """What `save_peft` wrote (or PEFT saved for the same modules) into adapter number `adapter` of
    `lora`, in place; a different rank, alpha or set of modules raises ValueError."""
    src = Path(path)
    config = json.loads((src / CONFIG_FILE).read_text())
    if config.get("r") != lora.rank or float(config.get("lora_alpha")) != float(lora.alpha):
        raise ValueError(f"{src}: adapter rank {config.get('r')} / alpha {config.get('lora_alpha')}, this run's "
                         f"trainer.lora.rank={lora.rank} / alpha={lora.alpha}: they must agree")
    native = {hf: name for name, hf in hf_module_names(lora, arch).items()}
    tensors: dict[str, torch.Tensor] = {}
    for key, t in load_file(str(src / WEIGHTS_FILE)).items():
        module, _, leaf = key.removeprefix(PEFT_PREFIX).partition(".lora_")
        leaf = leaf.replace(".default.", ".")  # PEFT's in-memory names carry the adapter name
        if module not in native:
            raise ValueError(f"{src}: the adapter has {module}, which this run does not adapt "
                             "(trainer.lora.target_modules differ)")
        tensors[f"{native[module]}.lora_{leaf}"] = t
    lora.load(tensors, adapter)
