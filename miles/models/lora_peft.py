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

Stacked MoE experts go in PEFT's `target_parameters` (its `ParamWrapper`, for transformers 5's fused
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I]): one `lora_A.weight` [E * rank,
in] (expert e's rows e * rank ...) and one `lora_B.weight` [out, rank * E] (expert e's columns e,
e + E, ...) per tensor, under the experts module's name. PEFT nests a second wrapped tensor of the
same module around the first, in the module's parameter order, so with both adapted gate_up_proj's
pair is `experts.base_layer.lora_*` and down_proj's `experts.lora_*`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from miles.models.families import get_family
from miles.models.lora import EXPERT_TENSORS, LoRA

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


def _is_expert(module: str) -> bool:
    return module.rpartition(".")[2] in EXPERT_TENSORS and ".experts." in module


def file_keys(names, arch) -> dict[str, str]:
    """LoRA tensor names ("<module>.lora_A.weight", LoRA.tensors()'s) -> their names in PEFT's file."""
    modules = sorted({name.partition(".lora_")[0] for name in names})
    hf = _hf_names(modules, arch)
    keys = {}
    for name in names:
        module, _, leaf = name.partition(".lora_")
        if not _is_expert(module):
            keys[name] = f"{PEFT_PREFIX}{hf[module]}.lora_{leaf}"
            continue
        owner, _, tensor = hf[module].rpartition(".")
        stem = module.rpartition(".")[0]
        wrapped = [t for t in EXPERT_TENSORS if f"{stem}.{t}" in modules]  # inner first
        nesting = "base_layer." * (len(wrapped) - 1 - wrapped.index(tensor))
        keys[name] = f"{PEFT_PREFIX}{owner}.{nesting}lora_{leaf}"
    return keys


def _to_file(name: str, t: torch.Tensor) -> torch.Tensor:
    """A stacked experts' A [E, r, in] -> [E * r, in]; B [E, out, r] -> [out, r * E] (PEFT's layouts)."""
    if t.dim() != 3:
        return t
    num, rows, cols = t.shape
    return t.reshape(num * rows, cols) if ".lora_A." in name else t.permute(1, 2, 0).reshape(rows, cols * num)


def _from_file(t: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """Inverse of _to_file, to the shape of this run's adapter `like`."""
    if like.dim() != 3:
        return t
    num, rows, cols = like.shape
    if ".lora_A." in name:
        return t.reshape(num, rows, cols)
    return t.reshape(rows, cols, num).permute(2, 0, 1)


def write_peft(tensors: dict[str, torch.Tensor], rank: int, alpha: float, arch, path, dropout: float = 0.0,
               base_model: str | None = None) -> dict[str, str]:
    """save_peft from adapters by name (LoRA.tensors()'s names, e.g. what a weight sync carries), as
    they are. Returns {native name: the file's tensor name}."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    modules = sorted({name.partition(".lora_")[0] for name in tensors})
    hf = _hf_names(modules, arch)
    keys = file_keys(list(tensors), arch)
    files = {keys[name]: _to_file(name, t.detach().to("cpu")).contiguous() for name, t in tensors.items()}
    save_file(files, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    projections = sorted(hf[m] for m in modules if not _is_expert(m))
    experts = sorted(hf[m] for m in modules if _is_expert(m))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": projections or None,
        "target_parameters": experts or None,
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
    mine = lora.tensors(adapter)
    native = {key: name for name, key in file_keys(list(mine), arch).items()}
    tensors: dict[str, torch.Tensor] = {}
    for key, t in load_file(str(src / WEIGHTS_FILE)).items():
        key = key.replace(".default.", ".")  # PEFT's in-memory names carry the adapter name
        if key not in native:
            raise ValueError(f"{src}: the adapter has {key.removeprefix(PEFT_PREFIX).partition('.lora_')[0]}, which "
                             "this run does not adapt (trainer.lora.target_modules differ)")
        tensors[native[key]] = _from_file(t, mine[native[key]], key)
    lora.load(tensors, adapter)
