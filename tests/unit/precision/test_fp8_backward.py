"""The FP8 backward (`precision.fp8_backward=fp8`, miles/precision/fp8_backward.py): dgrad and wgrad
quantize along the contracted axis in 128-wide tiles (DeepSeek-V3's tiling), checked against a
tile-by-tile reference written here; each training linear routes its gradients through them; the
recipe's forward keeps its bits, and the gradients stay near the bf16 backward's. The CPU runs the
emulated products; the scaled_mm kernels are checked on CUDA (tests/gpu/test_fp8_backward_cuda.py)."""

import copy

import pytest
import torch

from miles.config.schema import FP8Backward, FP8Scheme, PrecisionCfg, Quant
from miles.models import ArchConfig, CausalLM
from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight
from miles.precision.fp8_backward import TransposedFP8Weight, dgrad, probe_report, wgrad
from miles.precision.fp8_train import FP8WeightCache, fp8_train_linear, w8a16_train_linear
from miles.precision.recipe import Recipe

M, N, K = 200, 320, 384  # M not a multiple of 128: a padded tile along the tokens


def tiles_along(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t's values after FP8 quantization in 128-wide tiles along `dim` (amax / 448 scales), one tile at
    a time: the reference the backward must match."""
    moved = t.movedim(dim, -1).clone()
    for start in range(0, moved.shape[-1], 128):
        tile = moved[..., start:start + 128]
        scale = tile.abs().amax(-1, keepdim=True) / 448.0
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        moved[..., start:start + 128] = (tile / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return moved.movedim(-1, dim)


def operands(seed: int = 0):
    """g, x with magnitudes spread over both axes (so tiles along the wrong axis give other values), W."""
    gen = torch.Generator().manual_seed(seed)
    spread = lambda *shape: torch.exp2(torch.randint(-6, 7, shape, generator=gen).float())  # noqa: E731
    g = torch.randn(M, N, generator=gen) * spread(M, 1) * spread(1, N)
    x = torch.randn(M, K, generator=gen) * spread(M, 1) * spread(1, K)
    return g, x, torch.randn(N, K, generator=gen)


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_dgrad_tiles_the_output_gradient_along_n_and_uses_the_weights_blocks():
    g, _, w = operands()
    q, s = quantize_fp8_weight(w)
    ref = tiles_along(g, 1) @ dequantize_fp8_weight(q, s)
    assert close(dgrad(g, TransposedFP8Weight(q, s), torch.float32), ref) < 1e-5
    assert close(tiles_along(g, 0) @ dequantize_fp8_weight(q, s), ref) > 1e-3  # the wrong axis is seen


def test_wgrad_tiles_both_operands_along_the_tokens():
    g, x, _ = operands(1)
    ref = tiles_along(g, 0).t() @ tiles_along(x, 0)
    assert close(wgrad(g, x, torch.float32), ref) < 1e-5
    assert close(tiles_along(g, 1).t() @ tiles_along(x, 1), ref) > 1e-3
    assert close(ref, g.t() @ x) < 0.05  # FP8's rounding, not another product


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
def test_a_training_linear_routes_its_gradients_through_the_fp8_products(scheme):
    g, x, w = operands(2)
    w = w.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    cache = FP8WeightCache()
    y = (w8a16_train_linear(x, w, None, cache) if scheme == "w8a16"
         else fp8_train_linear(x, w, None, cache, fp8_backward=True))
    y.backward(g)
    q, s = quantize_fp8_weight(w.detach())
    x_in = x.detach() if scheme == "w8a16" else tiles_along(x.detach(), 1)  # w8a8: the forward's 1x128 x
    assert torch.equal(x.grad, dgrad(g, TransposedFP8Weight(q, s), torch.float32))
    assert torch.equal(w.grad, wgrad(g, x_in, torch.float32)) if scheme == "w8a16" else \
        close(w.grad, tiles_along(g, 0).t() @ tiles_along(x_in, 0)) < 1e-5


ARCH = ArchConfig(vocab_size=50, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, rope_theta=10000.0)


def recipe(scheme: str, backward: str) -> Recipe:
    cfg = PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme(scheme),
                       fp8_backward=FP8Backward(backward))
    return Recipe.from_cfg(cfg, ARCH.num_layers)


@pytest.mark.parametrize("scheme", ["w8a16", "w8a8"])
@pytest.mark.parametrize("autocast", [False, True])
def test_the_fp8_backward_keeps_the_forward_and_moves_the_gradients_little(scheme, autocast):
    model = CausalLM(ARCH, seed=0)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    grads, outs = {}, {}
    for backward in ("bf16", "fp8"):
        m = copy.deepcopy(model)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = recipe(scheme, backward).forward(m, ids)
        out.float().logsumexp(-1).sum().backward()
        outs[backward], grads[backward] = out, {n: p.grad for n, p in m.named_parameters()}
    assert torch.equal(outs["bf16"], outs["fp8"])  # the log-probs, hence step 1's ppo_kl = 0, are untouched
    q_proj = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(grads["bf16"][q_proj], grads["fp8"][q_proj])
    for name, ref in grads["bf16"].items():
        assert close(grads["fp8"][name].float(), ref.float()) < 0.1, name


def test_the_cpu_backward_is_the_emulated_product():
    assert probe_report(torch.device("cpu")).startswith("emulated")
