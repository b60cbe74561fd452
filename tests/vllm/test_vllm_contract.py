"""The rollout protocol's contract suite (tests/engine_contract.py, the same tests the native engine and the
SGLang stand-in pass in tests/unit/rollout/test_engine_contract.py) against the vLLM engine, on real vLLM;
then what is vLLM's own: one engine per process, and health() saying that the CPU has no sleep mode."""

import pytest

from vllm_tier import HAVE_VLLM, KV_CACHE_GB, NEEDS_VLLM, PROMPTS

if not HAVE_VLLM:
    pytest.skip(NEEDS_VLLM, allow_module_level=True)

pytest.register_assert_rewrite("engine_contract")

from engine_contract import *  # noqa: E402,F401,F403  (the suite's tests)
from engine_contract import Contract  # noqa: E402

pytestmark = pytest.mark.vllm


def build(ckpt, cfg):
    from miles.config.schema import DType
    from miles.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(ckpt, cfg, DType.fp32, kv_cache_gb=KV_CACHE_GB)


@pytest.fixture
def contract(vllm_engine, ckpt):
    """The shared engine; `build` closes it (one vLLM engine per process) and the fixture builds it again
    for the next test; a closed engine is what cannot serve."""
    return Contract(vllm_engine, "vllm", ckpt, build=lambda cfg: build(ckpt, cfg), kill=lambda engine: engine.close(),
                    dead=RuntimeError, dead_match="closed")


def test_one_engine_per_process(vllm_engine, ckpt):
    """Building a second engine closes the first (vLLM's parallel state is per process), which then says
    so; closing twice is a no-op."""
    from miles.config.schema import RolloutCfg

    engine = build(ckpt, RolloutCfg(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="closed"):
        vllm_engine.generate(PROMPTS, ["?"] * len(PROMPTS))
    assert len(engine.generate(PROMPTS[:1], ["?"], n=2)) == 2
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.update_weights({})


def test_health_says_the_cpu_frees_no_memory(vllm_engine):
    """The documented CPU behaviour of release_memory / resume_memory (no sleep mode): bookkeeping only."""
    health = vllm_engine.health()
    assert health["vllm_version"] and health["dtype"] == "fp32" and health["frees_memory"] is False
    assert "free nothing" in health["memory_note"]
    vllm_engine.release_memory()
    assert vllm_engine.health()["frees_memory"] is False
    vllm_engine.resume_memory()
    assert vllm_engine.health()["resident"] == ["weights", "kv_cache"]
