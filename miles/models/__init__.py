"""Miles' own decoder implementations of every supported family, shared by the trainer and the
rollout engine.

    cfg = ArchConfig(...) or from_hf_config(json.load(open("config.json")))
    model = CausalLM(cfg, seed=0)            # or from_pretrained(hf_checkpoint_dir)
    logits = model(input_ids, attention_mask, position_ids)            # training
    cache = model.new_cache(batch, max_len); model(ids, mask, pos, cache=cache)  # decoding
    save_pretrained(model, out_dir)          # loadable by transformers
    total, active = param_count(cfg)

The names below load on first use (PEP 562): the config schema imports `miles.models.config` (plain
dataclasses), and importing this package must not import torch with it, so that `python launch.py`
composes and refuses a bad command line without loading torch (~2 s a process).
"""

from importlib import import_module

_EXPORTS = {
    "ArchConfig": "miles.models.config",
    "from_hf_config": "miles.models.config",
    "CausalLM": "miles.models.causal_lm",
    "FAMILIES": "miles.models.families",
    "ModelCache": "miles.models.cache",
    "from_pretrained": "miles.models.hf_io",
    "save_pretrained": "miles.models.hf_io",
    "param_count": "miles.models.params",
}
__all__ = ["ArchConfig", "CausalLM", "FAMILIES", "ModelCache", "from_pretrained", "save_pretrained",
           "from_hf_config", "param_count"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
