"""What the vLLM engine refuses, and the message a missing vLLM gives: checked before vLLM is imported,
so this module runs in the main venv too (`make test`), where vLLM is absent."""

import pytest

from vllm_tier import HAVE_VLLM

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("change, key", [
    (dict(record_routing=True), "algo.routing_replay=r3"),
    (dict(true_on_policy="fp32"), "true_on_policy"),
    (dict(precision="fp8"), "quantized rollout"),
    (dict(top_k=5), "rollout.top_k=0"),
    (dict(top_p=0.9), "rollout.top_p=1.0"),
])
def test_unsupported_options_are_clear_errors(ckpt, change, key):
    from miles.config.schema import DType, PrecisionCfg, Quant, RolloutCfg
    from miles.rollout.vllm_engine import VLLMEngine

    cfg = RolloutCfg(top_k=change.pop("top_k", 0), top_p=change.pop("top_p", 1.0))
    if change.pop("precision", None):
        change["precision"] = PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8,
                                           rollout_dtype=DType.bf16)
    with pytest.raises(ValueError, match="rollout=vllm") as err:
        VLLMEngine(ckpt, cfg, DType.fp32, **change)
    assert key in str(err.value)


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed: the missing-package message cannot show here")
def test_missing_vllm_names_the_install(ckpt):
    from miles.config.schema import DType, RolloutCfg
    from miles.rollout.vllm_engine import VLLMEngine

    with pytest.raises(ImportError, match="make vllm-env") as err:
        VLLMEngine(ckpt, RolloutCfg(), DType.fp32)
    assert "miles[vllm]" in str(err.value)
