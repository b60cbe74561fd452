"""Load and save CausalLM weights in the HuggingFace checkpoint layout (safetensors).

A checkpoint directory holds `config.json` plus either `model.safetensors` or shards
`model-0000x-of-0000y.safetensors` listed in `model.safetensors.index.json`.
Tensor names and layouts are translated by the checkpoint's family (`miles.models.families`):
one table per family, used in both directions; names are checked strictly (missing or
unexpected tensors raise ValueError).
Loading builds the model on the meta device and adopts the checkpoint tensors directly,
so no memory or time is spent on a random initialization that would be overwritten.

MTP modules are built as config.json counts them, except when the checkpoint holds none of their
tensors: transformers 5 writes `num_nextn_predict_layers: 1` for every DeepSeek-V3 / GLM-4.5 model
it saves (its MTP model is a separate one), and such a checkpoint loads without MTP modules.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.models.causal_lm import CausalLM
from miles.models.config import from_hf_config
from miles.models.families import get_family
from miles.models.vlm import VisionLM

PathLike = Union[str, Path]

# Non-learned buffers some older checkpoints contain; RoPE tables are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def model_class(cfg) -> type[CausalLM]:
    """VisionLM for the vision-language families (a vision block), else the text-only CausalLM."""
    return VisionLM if cfg.vision is not None else CausalLM


def _read_tensors(path: Path, device: Union[str, torch.device]) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory, keyed by HF name."""
    if (path / _SINGLE_FILE).exists():
        files = [path / _SINGLE_FILE]
    elif (path / _INDEX_FILE).exists():
        weight_map = json.loads((path / _INDEX_FILE).read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(f"{path}: neither {_SINGLE_FILE} nor {_INDEX_FILE} found")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(device)) as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _drop_tied_lm_head(hf_tensors: dict[str, torch.Tensor]) -> None:
    """Some tied checkpoints still store lm_head.weight; accept it only if it is the embedding."""
    head = hf_tensors.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, hf_tensors.get("model.embed_tokens.weight", head)):
        raise ValueError("tie_word_embeddings is set but lm_head.weight differs from model.embed_tokens.weight")


def from_pretrained(
    path: PathLike, dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"
) -> CausalLM:
    """Load an HF checkpoint directory of any supported family into a CausalLM (VisionLM for a
    vision-language family) with weights in `dtype`.

    Raises ValueError naming missing or unexpected tensors, or an unsupported model_type.
    """
    path = Path(path)
    cfg = from_hf_config(json.loads((path / "config.json").read_text()))
    family = get_family(cfg.family)
    hf_tensors = {
        k: v for k, v in _read_tensors(path, device).items()
        if not k.endswith(_IGNORED_SUFFIXES) and not family.ignored(k, cfg)
    }
    # Layout conversions (e.g. per-expert tensors stacked into fused ones) keep HF names.
    tensors = family.from_hf_tensors(hf_tensors, cfg)
    if cfg.tie_word_embeddings:
        _drop_tied_lm_head(tensors)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    expected = {family.to_hf_name(n): n for n in model.state_dict()}
    if cfg.mtp_layers and not any(n.startswith("mtp.") and k in tensors for k, n in expected.items()):
        cfg = dataclasses.replace(cfg, mtp_layers=0)  # config.json counts MTP layers it does not hold
        with torch.device("meta"):
            model = model_class(cfg)(cfg)
        expected = {family.to_hf_name(n): n for n in model.state_dict()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match the {cfg.model_type} architecture; "
            f"missing tensors: {missing}; unexpected tensors: {unexpected}"
        )
    state = {}
    for hf_name, ours in expected.items():
        tensor = tensors[hf_name]
        want = model.get_parameter(ours).shape
        if tensor.shape != want:
            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(want)}")
        state[ours] = tensor.to(dtype)
    # assign=True adopts the loaded tensors in place of the meta parameters.
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_pretrained(model: CausalLM, path: PathLike, dtype: Optional[torch.dtype] = None) -> None:
    """Write config.json + model.safetensors so that both `from_pretrained` and
    `transformers.AutoModelForCausalLM.from_pretrained` load it. `dtype` defaults to the
    model's; a tied lm_head is stored once (as model.embed_tokens.weight)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    dtype = dtype or model.dtype
    family = get_family(model.config.family)
    tensors = {
        family.to_hf_name(name): t.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, t in model.state_dict().items()
    }
    tensors = family.to_hf_tensors(tensors, model.config)
    dtype_name = str(dtype).removeprefix("torch.")
    config = model.config.to_hf_config(dtype=dtype_name)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(path / _SINGLE_FILE), metadata={"format": "pt"})
