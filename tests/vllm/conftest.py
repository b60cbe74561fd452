"""Fixtures of the vLLM tier (tests/vllm, `make test-vllm`): real vLLM on the CPU, no stand-ins.

The modules that need vLLM skip themselves where it is not installed (the main venv: `make test`);
vLLM is imported by the fixtures, never at collection, so that the engine sets up its environment first.
One engine serves most tests: starting one costs seconds, importing vLLM tens of them.
"""

import pytest

from vllm_tier import ALPHABET, KV_CACHE_GB, tiny_model_cfg


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A seeded random qwen3_tiny, as the project writes its initial checkpoints (HF format, char tokenizer)."""
    from miles.orchestrate.checkpoints import random_checkpoint

    return str(random_checkpoint(tiny_model_cfg(), ALPHABET, 0, tmp_path_factory.mktemp("qwen3_tiny")))


_SHARED: dict = {}


@pytest.fixture
def vllm_engine(ckpt):
    """The shared fp32 engine (max_new_tokens=8, seed 0), built again when a test built another
    one: vLLM holds one live engine per process (a new VLLMEngine closes the previous)."""
    from miles.config.schema import DType, RolloutCfg
    from miles.rollout.vllm_engine import VLLMEngine

    engine = _SHARED.get("engine")
    if engine is None or engine.llm is None:
        engine = _SHARED["engine"] = VLLMEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0,
                                                kv_cache_gb=KV_CACHE_GB)
    return engine


@pytest.fixture(scope="session")
def native_engine(ckpt):
    from miles.config.schema import DType, RolloutCfg
    from miles.rollout.native import NativeEngine

    return NativeEngine(ckpt, RolloutCfg(max_new_tokens=8), DType.fp32, threads=2, seed=0)
