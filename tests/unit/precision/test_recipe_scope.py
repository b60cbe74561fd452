"""What the quantizing recipes quantize, on every family: GEMM weights only (nn.Linear weights and the
stacked MoE experts), never a router or a depthwise convolution.

Llama 4's router is an nn.Linear named `router` that `Llama4MoE` reads directly: before the keep lists
named it, the INT4 engine failed at its first generate and the FP8 engine multiplied the router's e4m3
codes without their scales (wrong routing, silently). Qwen3-Next's `conv1d` kernels were fake-quantized.
"""

from pathlib import Path

import pytest
from torch import nn

from miles.orchestrate.checkpoints import model_class
from miles.precision.recipe import Recipe

TINY = sorted(p.stem for p in (Path(__file__).parents[3] / "conf" / "model").glob("*_tiny.yaml"))
QUANTIZING = ["fp8", "int4_qat", "bf16_train_fp8_rollout", "bf16_train_int4_rollout"]


def _quantized(compose, model: str, precision: str) -> tuple[nn.Module, list[str]]:
    cfg = compose([f"model={model}", f"precision={precision}"])
    arch = cfg.model.arch(128, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    net = model_class(arch)(arch)
    recipe = Recipe.from_cfg(cfg.precision, arch.num_layers)
    return net, [n for n, p in net.named_parameters() if recipe.quantizes(n, p)]


@pytest.mark.parametrize("precision", QUANTIZING)
@pytest.mark.parametrize("model", TINY)
def test_only_gemm_weights_are_quantized(compose, model, precision):
    net, quantized = _quantized(compose, model, precision)
    gemms = {f"{name}.weight" for name, m in net.named_modules() if isinstance(m, nn.Linear)}
    stacked = {n for n, _ in net.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert quantized, "the recipe quantizes nothing: the test would prove nothing"
    assert set(quantized) <= gemms | stacked, sorted(set(quantized) - gemms - stacked)
    routers = [n for n in quantized if n.endswith(("gate.weight", "router.weight")) and ".mlp." in n]
    assert not routers, routers


def test_llama4_router_is_kept_and_its_experts_are_not(compose):
    _, quantized = _quantized(compose, "llama4_tiny", "int4_qat")
    assert not any("router" in n for n in quantized)
    assert any("experts" in n for n in quantized)
