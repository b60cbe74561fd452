"""Shared by the vLLM tier's modules (a module of its own: the name `conftest` is shadowed by the
other tiers' conftest.py files in a whole-suite run)."""

import importlib.util


def _have_vllm() -> bool:
    # Not just find_spec: with tests/ on sys.path this folder itself is a namespace package "vllm".
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


HAVE_VLLM = _have_vllm()
NEEDS_VLLM = "vllm is not installed here: `make vllm-env` creates .venv-vllm, `make test-vllm` runs this tier"
# The default experiment's model (conf/model/qwen3_tiny.yaml) and task alphabet.
ALPHABET = "0123456789+-*=() "
PROMPTS = ["12+30=", "7+5=", "99+1=", "45+45="]
KV_CACHE_GB = 0.25  # plenty for these shapes; one allocation per engine


def tiny_model_cfg():
    from miles.config.schema import ModelCfg

    return ModelCfg(name="qwen3_tiny", hidden_size=128, intermediate_size=384, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=64,
                    tie_word_embeddings=True)
