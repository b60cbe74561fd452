"""The trainer's MoE experts on CUDA: two grouped GEMMs (torch._grouped_mm,
miles.models.moe.grouped_swiglu) in place of the expert loop, for both stack layouts (Experts, Llama
4's). Outputs and every gradient against the loop at Qwen3-30B-A3B widths, as the trainer runs them
(fp32 masters under bf16 autocast) and as the bf16 engine does; the same bits on a second run (the
GRPO invariants need a deterministic forward). The CPU tests (tests/unit/models/test_moe.py) check
the padding and the empty groups. Skipped without a GPU.
"""

import pytest
import torch

from miles.models import moe
from miles.models.llama4 import Llama4Experts
from miles.models.moe import Experts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _case(cls, rows: int, dtype: torch.dtype):
    """Qwen3-30B-A3B's expert widths (hidden 2048, width 768) with 32 of its 128 experts, top-8."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts = cls(32, 2048, 768).to(device="cuda", dtype=dtype)
    experts.init_weights(gen)
    x = torch.randn(rows, 2048, device="cuda", generator=gen)
    chosen = torch.rand(rows, 32, device="cuda", generator=gen).topk(8, dim=-1).indices
    weights = torch.rand(rows, 8, device="cuda", generator=gen)
    return experts, x, chosen, weights


def _run(experts, x0, chosen, weights, autocast: bool, monkeypatch, grouped: bool = True):
    monkeypatch.setattr(moe, "GROUPED_GEMM_DEVICES", ("cuda",) if grouped else ())
    experts.zero_grad()
    x = x0.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert moe.grouped_gemm_applies(experts, x) == grouped
        out = experts(x, chosen, weights)
    (out.float() * torch.linspace(-1, 1, out.shape[-1], device="cuda")).sum().backward()
    return [out.detach().float(), x.grad.float(), experts.gate_up_proj.grad.float(), experts.down_proj.grad.float()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("cls", [Experts, Llama4Experts])
@pytest.mark.parametrize("rows", [5, 300])
@pytest.mark.parametrize("autocast", [True, False], ids=["fp32-masters-autocast", "bf16"])
def test_grouped_gemms_equal_the_loop_and_repeat_their_bits(rows, autocast, cls, monkeypatch):
    experts, x, chosen, weights = _case(cls, rows, torch.float32 if autocast else torch.bfloat16)
    x = x if autocast else x.bfloat16()
    loop = _run(experts, x, chosen, weights, autocast, monkeypatch, grouped=False)
    grouped = _run(experts, x, chosen, weights, autocast, monkeypatch)
    for a, b in zip(grouped, loop):  # bf16 GEMMs with other tiles and summation orders
        assert _rel(a, b) < 1e-2
    again = _run(experts, x, chosen, weights, autocast, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(again, grouped))
