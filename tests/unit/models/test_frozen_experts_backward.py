"""QLoRA's expert holders (miles/models/frozen_experts.py) rebuild each expert's dequantized slice in
backward instead of keeping it from the forward: what autograd saves in one MoE layer's forward,
counted with saved_tensors_hooks, against the same layer over plain frozen stacks of the same values
(what the holders saved before: the expert loop's matmul keeps its weight operand), and the numbers
(output, input gradient, adapter gradients) bit for bit those of that layer.

Both layouts (miles.models.moe.Experts [E, out, in], Llama 4's [E, in, out]), FP8 and INT4, fp32 and
under bf16 autocast (where the saved operand is autocast's bf16 copy of the slice).
"""

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from miles.config.schema import DType, PrecisionCfg, Quant
from miles.models.frozen_experts import HOLDER
from miles.models.llama4 import Llama4Experts
from miles.models.lora import LoRA
from miles.models.moe import Experts
from miles.precision.recipe import Recipe

E, H, I, N, K = 4, 128, 128, 12, 2  # whole 128-blocks and INT4 groups; 12 tokens, 2 experts each
SLICE_ELEMENTS = 2 * I * H + H * I  # one expert's gate_up_proj + down_proj


class Layer(nn.Module):
    """One decoder layer's experts, named as LoRA finds them (layers.0.mlp.experts)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = nn.Module()
        self.layers[0].mlp.experts = experts

    @property
    def experts(self) -> nn.Module:
        return self.layers[0].mlp.experts


def layers(kind: type, quant: str) -> tuple[Layer, Layer]:
    """(the QLoRA holder, plain frozen stacks of its dequantized values), each with the same adapters
    (B drawn non-zero, so the adapters' path is not trivially zero)."""
    master = kind(E, H, I)
    master.init_weights(torch.Generator().manual_seed(0))
    recipe = Recipe.from_cfg(PrecisionCfg(name=quant, train_dtype=DType.fp32, rollout_dtype=DType.fp32,
                                          train_quant=Quant(quant), rollout_quant=Quant(quant)), num_layers=1)
    held = Layer(HOLDER[kind](master, recipe))
    dense = kind(E, H, I)  # not `master`: the holder took over its lora_hooks
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            getattr(dense, name).copy_(held.experts.dequantized(name))
    plain = Layer(dense.requires_grad_(False))
    for layer in (held, plain):
        layer.lora = LoRA(layer, rank=4, alpha=8.0, target_modules=["experts"], dtype=torch.float32, seed=0)
        with torch.no_grad():
            for b in layer.lora.lora_B:
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(1)))
    return held, plain


def run(layer: Layer, autocast: bool) -> tuple[list[tuple[tuple[int, ...], torch.dtype, int]], dict]:
    """One forward and backward: (shape, dtype, bytes) of each tensor autograd saved for backward, and
    the output, the input's gradient and the adapters' gradients."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(N, H, generator=gen, requires_grad=True)
    experts = torch.tensor([[t % E, (t + 1 + t // E) % E] for t in range(N)])  # every expert used, 6 pairs each
    weights = torch.rand(N, K, generator=gen)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer.experts(x, experts, weights)
    y.float().square().sum().backward()
    grads = {f"{k}.{i}": p.grad for k, ps in (("A", layer.lora.lora_A), ("B", layer.lora.lora_B))
             for i, p in enumerate(ps)}
    return saved, {"y": y.detach(), "x.grad": x.grad, **grads}


def expert_slices(kind: type) -> set[tuple[int, ...]]:
    """The shapes of one expert's slices, as stored and as the matmul may save them (transposed)."""
    shapes = {(2 * I, H), (H, I)} if kind is Experts else {(H, 2 * I), (I, H)}
    return shapes | {s[::-1] for s in shapes}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("quant", ["fp8", "int4"])
@pytest.mark.parametrize("kind", [Experts, Llama4Experts], ids=["stacked", "llama4"])
def test_backward_rebuilds_the_expert_instead_of_keeping_it(kind, quant, autocast):
    held, plain = layers(kind, quant)
    after, got = run(held, autocast)
    before, want = run(plain, autocast)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert any(g.abs().sum() > 0 for k, g in got.items() if k.startswith("A."))  # the adapters' backward ran

    dtype = torch.bfloat16 if autocast else torch.float32
    kept = [s for s in before if s[0] in expert_slices(kind) and s[1] == dtype]
    assert not [s for s in after if s[0] in expert_slices(kind) and s[1] == dtype]
    # Before: the two slices of each of the E experts (all routed to).
    assert sum(b for _, _, b in kept) == E * SLICE_ELEMENTS * dtype.itemsize
    # Nothing else changed: the rest of what is saved (activations, the adapters' operands) is the same.
    rest = sorted(before, key=str)
    for s in kept:
        rest.remove(s)
    assert sorted(after, key=str) == rest
    print(f"\n{kind.__name__} {quant} {'bf16 autocast' if autocast else 'fp32'}: saved for backward "
          f"{sum(b for _, _, b in before)} B over plain stacks (the holder before), {sum(b for _, _, b in after)} B "
          f"by the holder")


@pytest.mark.parametrize("kind", [Experts, Llama4Experts], ids=["stacked", "llama4"])
def test_no_dequantized_slice_outlives_the_forward(kind, monkeypatch):
    """Not only autograd's saved tensors: nothing (a Function's ctx included) holds the memory of a slice
    dequantized in the forward once it has returned (its storage, which a saved view would keep:
    before, all 2E were alive here); backward dequantizes each used expert's two slices once more."""
    held, _ = layers(kind, "int4")
    made = []
    dequantize = held.experts._dequantize

    def tracked(*args):
        t = dequantize(*args)
        made.append(StorageWeakRef(t.untyped_storage()))
        return t

    monkeypatch.setattr(held.experts, "_dequantize", tracked)
    x = torch.randn(N, H, requires_grad=True)
    y = held.experts(x, torch.tensor([[t % E, (t + 1) % E] for t in range(N)]), torch.rand(N, K))
    assert len(made) == 2 * E and all(ref.expired() for ref in made)
    y.sum().backward()
    assert len(made) == 4 * E and x.grad is not None
