"""The FP8 backward on CUDA (`precision.fp8_backward=fp8`, miles/precision/fp8_backward.py): the probe
finds torch's blockwise scaled_mm kernels, which give the emulated products (the CPU tests' reference)
to the kernels' rounding at 4B-layer shapes; the fused quantizer reads transposed views bit for bit;
the recipe's forward keeps its bits on CUDA under bf16 autocast.

Skipped without a GPU (CI). On a GPU machine: `pytest -s tests/gpu/test_fp8_backward_cuda.py`."""

import copy

import pytest
import torch

from miles.config.schema import FP8Backward, FP8Scheme, PrecisionCfg, Quant
from miles.models import ArchConfig, CausalLM
from miles.precision import quantize_fp8_act, quantize_fp8_weight
from miles.precision.fp8 import _pad, dequantize_fp8_act, dequantize_fp8_weight
from miles.precision.fp8_backward import TransposedFP8Weight, dgrad, kernels_usable, probe_report, wgrad
from miles.precision.fp8_triton import quantize_act_fused
from miles.precision.recipe import Recipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _rel(y, ref):
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def test_the_probe_finds_the_kernels():
    print(probe_report(DEV))
    assert kernels_usable(DEV), probe_report(DEV)


@pytest.mark.parametrize("m,k", [(200, 384), (4096, 2560)])
def test_the_fused_quantizer_reads_a_transposed_view_bitwise(m, k):
    g = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(k, m, device="cuda", generator=g) * torch.exp2(
        torch.randint(-8, 8, (1, m), device="cuda", generator=g).float())).to(torch.bfloat16)
    view = x.t()  # [m, k] with strides (1, m)
    kp = -(-k // 128) * 128
    q, s = quantize_act_fused(view, kp)
    q_ref, s_ref = quantize_fp8_act(_pad(view.contiguous(), (0, kp - k, 0, q.shape[0] - m)))
    assert torch.equal(_bits(q), _bits(q_ref)) and torch.equal(_bits(s), _bits(s_ref))


# Qwen3-4B's layers (N x K): qkv, o, gate_up, down; M: a micro-batch's tokens, one not a multiple of 128.
@pytest.mark.parametrize("n,k", [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)])
@pytest.mark.parametrize("m", [1000, 4096])
def test_the_kernels_give_the_emulated_products(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    g = (torch.randn(m, n, device="cuda", generator=gen) * 1e-3).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    q, s = quantize_fp8_weight(torch.randn(n, k, device="cuda", generator=gen) * 0.02)
    deq = lambda t: dequantize_fp8_act(*quantize_fp8_act(t))  # noqa: E731  (1x128 along the last axis, fp32)
    ref_x = deq(g) @ dequantize_fp8_weight(q, s)
    ref_w = deq(g.t()) @ deq(x.t()).t()
    assert _rel(dgrad(g, TransposedFP8Weight(q, s), torch.bfloat16), ref_x) < 1e-2
    assert _rel(wgrad(g, x, torch.bfloat16), ref_w) < 1e-2


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
def test_the_recipe_keeps_its_forward_bits_on_cuda(scheme):
    arch = ArchConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_layers=2, num_heads=8,
                      num_kv_heads=4, head_dim=64, rope_theta=10000.0)
    model = CausalLM(arch, seed=0).to(DEV)
    ids = torch.randint(0, 512, (4, 96), device=DEV, generator=torch.Generator(device="cuda").manual_seed(0))
    outs, grads = {}, {}
    for backward in ("bf16", "fp8"):
        m = copy.deepcopy(model)
        cfg = PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme(scheme),
                           fp8_backward=FP8Backward(backward))
        with torch.autocast("cuda", torch.bfloat16):
            out = Recipe.from_cfg(cfg, arch.num_layers).forward(m, ids)
        out.float().logsumexp(-1).sum().backward()
        outs[backward], grads[backward] = out, {n: p.grad for n, p in m.named_parameters()}
    assert torch.equal(outs["bf16"], outs["fp8"])
    for name, ref in grads["bf16"].items():
        assert _rel(grads["fp8"][name], ref) < 0.1, name
