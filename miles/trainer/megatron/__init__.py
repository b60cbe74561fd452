"""Megatron-core trainer backend (`trainer=megatron`, docs/megatron.md).

  core_attention.py  the project's core attention for the spec (PyTorch SDPA, MLA's k / v channels)
  dsa_attention.py   DSA's core attention (DeepSeek-V3.2, GLM-5): the native lightning indexer, top-k, sparse SDPA
  router.py   DeepSeek's group-limited router (groups ranked by their top two scores)
  arch.py     ArchConfig -> TransformerConfig / layer spec / GPTModel arguments, and what is not mapped
  weights.py  native (HF) tensors <-> GPTModel state-dict names and layouts
  rules.py    what trainer=megatron combines with (config validation)
  offload.py  colocation offload through megatron-core's buffers (params, grads, optimizer)
  quant.py    the precision recipes: INT4 QAT fake quantization by row masks, quantized sync payloads
  lora.py     LoRA: the native adapters hooked onto the fused linears (rows placed through the weight map)
  specs.py    the decoder block spec (which modules megatron-core builds per layer)
  trainer.py  MegatronTrainer: the shared RL update (rl_update.py) over a GPTModel policy and Megatron's optimizer

arch, weights, rules and lora's row placement are pure (no megatron import: CPU tests); trainer imports
megatron-core lazily.
"""

from __future__ import annotations


def require_megatron() -> None:
    """Import megatron-core, or fail naming what to install."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError("trainer=megatron needs megatron-core (Python >= 3.12, CUDA): "
                          "pip install -e '.[megatron]' (or megatron-core==0.19.2)") from e
