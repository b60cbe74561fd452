"""Miles' own decoder implementations of every supported family, shared by the trainer and the
rollout engine.

    cfg = ArchConfig(...) or from_hf_config(json.load(open("config.json")))
    model = CausalLM(cfg, seed=0)            # or from_pretrained(hf_checkpoint_dir)
    logits = model(input_ids, attention_mask, position_ids)            # training
    cache = model.new_cache(batch, max_len); model(ids, mask, pos, cache=cache)  # decoding
    save_pretrained(model, out_dir)          # loadable by transformers
    total, active = param_count(cfg)
"""

from miles.models.cache import ModelCache
from miles.models.causal_lm import CausalLM
from miles.models.config import ArchConfig, from_hf_config
from miles.models.families import FAMILIES
from miles.models.hf_io import from_pretrained, save_pretrained
from miles.models.params import param_count

__all__ = ["ArchConfig", "CausalLM", "FAMILIES", "ModelCache", "from_pretrained", "save_pretrained",
           "from_hf_config", "param_count"]
