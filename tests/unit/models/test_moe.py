"""MoE routing against hand-computed cases, the fused expert compute against a per-token loop,
routing record / replay, and the per-expert <-> fused checkpoint layout."""

import math
from types import SimpleNamespace

import pytest
import torch
from zoo_checks import backward_nodes

from miles.models import CausalLM, invariant, moe, param_count
from miles.models.config import ArchConfig, MoEConfig
from miles.models.families.moe_io import fuse_experts, split_experts
from miles.models.llama4 import Llama4Experts
from miles.models.moe import Experts, MoE, route, sum_in_expert_order


def logit(p):
    """Inverse sigmoid, so sigmoid scores can be written down directly."""
    return [math.log(x / (1 - x)) for x in p]


def test_softmax_topk_renormalized():
    # softmax(log [1, 2, 3, 4]) = [.1, .2, .3, .4]: top-2 = experts 3, 2 with weights .4/.7, .3/.7
    logits = torch.tensor([[math.log(v) for v in (1.0, 2.0, 3.0, 4.0)]])
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, scoring="softmax", norm_topk_prob=True)
    experts, weights = route(logits, moe)
    assert experts.tolist() == [[3, 2]]
    torch.testing.assert_close(weights, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))
    moe.norm_topk_prob, moe.routed_scaling_factor = False, 2.5
    torch.testing.assert_close(route(logits, moe)[1], torch.tensor([[0.4, 0.3]]) * 2.5)


def test_sigmoid_bias_selects_but_does_not_weight():
    # scores [.9, .8, .3, .2]; the bias lifts expert 2 to 1.0 for selection: top-2 = {2, 0};
    # the weights come from the unbiased scores .3 and .9, renormalized: .25, .75.
    logits = torch.tensor([logit([0.9, 0.8, 0.3, 0.2])])
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, scoring="sigmoid", score_correction_bias=True)
    experts, weights = route(logits, moe, bias=torch.tensor([0.0, 0.0, 0.7, 0.0]))
    assert experts.tolist() == [[2, 0]]
    torch.testing.assert_close(weights, torch.tensor([[0.25, 0.75]]))


def test_group_limited_topk():
    # 4 groups of 2: sums of top-2 = 1.0, 1.2, 1.1, 0.2 -> groups 1 and 2 allowed; the best single
    # expert (0, score .95) is in group 0 and must not be chosen: top-2 = experts 2 (.7), 4 (.6).
    p = [0.95, 0.05, 0.7, 0.5, 0.6, 0.5, 0.1, 0.1]
    logits = torch.tensor([logit(p)])
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, scoring="sigmoid", n_group=4, topk_group=2)
    experts, weights = route(logits, moe)
    assert experts.tolist() == [[2, 4]]
    torch.testing.assert_close(weights, torch.tensor([[0.7 / 1.3, 0.6 / 1.3]]))
    moe.n_group = 1  # without groups the global top-2 wins
    assert route(logits, moe)[0].tolist() == [[0, 2]]


def _arch(**moe_kw) -> ArchConfig:
    """A small MoE architecture; the MoE options are set after construction because the module is
    family-agnostic while each family admits only its own router (qwen3_moe: plain softmax)."""
    arch = ArchConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8, family="qwen3_moe",
                      moe=MoEConfig(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8))
    for key, value in moe_kw.items():
        setattr(arch.moe, key, value)
    return arch


def _randomized_moe(**moe_kw) -> MoE:
    torch.manual_seed(0)
    layer = MoE(_arch(**moe_kw), 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    return layer


def test_experts_match_a_per_token_loop():
    layer = _randomized_moe()
    x = torch.randn(2, 5, 16)
    ctx = SimpleNamespace(routing_record={}, routing_replay=None)
    out = layer(x, ctx)
    experts, weights = layer.gate(x.reshape(-1, 16))
    ref = torch.zeros(10, 16)
    for n, tok in enumerate(x.reshape(-1, 16)):
        for e, w in zip(experts[n].tolist(), weights[n]):
            gate, up = (layer.experts.gate_up_proj[e] @ tok).chunk(2)
            ref[n] += w * (layer.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out.reshape(-1, 16), ref)
    # the record is what the router chose, per [B, T]
    assert torch.equal(ctx.routing_record[0], experts.view(2, 5, 2))


def test_expert_stacks_get_their_gradients_from_one_unbind():
    """The expert loop takes the stacks' slices from one unbind each: one node stacks every expert's
    gradient. A slice per expert made each expert's gradient a zero-filled tensor of the whole stack
    (3.1x the expert layer's forward + backward on the CPU, most of a MoE training step on a GPU).
    The gradients are the per-token loop's."""
    layer = _randomized_moe()
    x = torch.randn(10, 16, requires_grad=True)
    with torch.no_grad():
        experts, weights = layer.gate(x)
    out = layer.experts(x, experts, weights)
    nodes = backward_nodes(out)
    assert nodes.count("UnbindBackward0") == 2 and "SelectBackward0" not in nodes
    assert "SplitWithSizesBackward0" in nodes and "SliceBackward0" not in nodes  # the tokens: one split
    out.square().sum().backward()
    stacks = [layer.experts.gate_up_proj, layer.experts.down_proj]
    got = [p.grad.clone() for p in stacks]
    for p in stacks:
        p.grad = None
    ref = torch.zeros(10, 16)
    for n, tok in enumerate(x):
        for e, w in zip(experts[n].tolist(), weights[n]):
            gate, up = (layer.experts.gate_up_proj[e] @ tok).chunk(2)
            ref[n] += w * (layer.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    ref.square().sum().backward()
    for g, p in zip(got, stacks):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)  # another summation order
    with torch.no_grad():  # no gradients: the holder's expert_weight, slice by slice (no unbind)
        assert layer.experts(x, experts, weights).grad_fn is None


def test_the_inputs_gradient_has_the_same_bits_every_run():
    """Each token's k gradients are summed in a fixed order (moe.pairs_by_expert). Gathered as
    x[order // k], index_put's accumulation added them in thread order: on 2 CPU threads x's gradient
    differed between two identical backward passes."""
    torch.manual_seed(0)
    layer = Experts(16, 128, 64)
    layer.init_weights(torch.Generator().manual_seed(0))
    x0 = torch.randn(1024, 128)
    experts = torch.rand(1024, 16).topk(8, dim=-1).indices
    weights = torch.rand(1024, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(5):
            x = x0.clone().requires_grad_()
            layer(x, experts, weights).square().sum().backward()
            grads.append(x.grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(g, grads[0]) for g in grads[1:])


def _grouped_case(cls=Experts):
    """Experts whose widths keep the grouped GEMM's rows 16-byte aligned, 37 tokens, and an expert
    nobody chose (an empty group), so the groups' sizes are not multiples of GROUP_ALIGN."""
    torch.manual_seed(0)
    layer = cls(8, 64, 32)
    layer.init_weights(torch.Generator().manual_seed(0))
    experts = torch.rand(37, 8).topk(2, dim=-1).indices
    experts = torch.where(experts == 3, (experts + 2) % 8, experts)  # expert 3: no tokens
    return layer, torch.randn(37, 64), experts, torch.rand(37, 2)


def _forward_backward(layer, x0, experts, weights, grouped, monkeypatch, autocast=False):
    monkeypatch.setattr(moe, "GROUPED_GEMM_DEVICES", ("cuda", "cpu") if grouped else ("cuda",))
    layer.zero_grad()
    x = x0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        assert moe.grouped_gemm_applies(layer, x) == grouped
        out = layer(x, experts, weights)
    (out.float() * torch.linspace(-1, 1, 64)).sum().backward()
    return [out.detach(), x.grad, layer.gate_up_proj.grad, layer.down_proj.grad]


@pytest.mark.parametrize("cls", [Experts, Llama4Experts])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_grouped_gemm_experts_equal_the_loop(monkeypatch, autocast, cls):
    """The two grouped GEMMs (torch._grouped_mm, CUDA's path) give the loop's outputs and gradients, for
    both stack layouts ([E, out, in] and Llama 4's [E, in, out]): groups padded to GROUP_ALIGN rows, an
    empty group, autocast's dtype as the loop's matmuls. On the CPU both multiply group by group, so
    bf16 agrees bit for bit and fp32 to its rounding."""
    layer, x0, experts, weights = _grouped_case(cls)
    loop = _forward_backward(layer, x0, experts, weights, False, monkeypatch, autocast)
    grouped = _forward_backward(layer, x0, experts, weights, True, monkeypatch, autocast)
    assert loop[2][3].abs().sum() == 0 and all(t.abs().sum() > 0 for t in loop)  # expert 3 idle, the rest not
    for a, b in zip(grouped, loop):
        if autocast:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_grouped_gemm_leaves_the_loop_to_what_needs_it(monkeypatch):
    """Expert LoRA hooks, batch-invariant kernels (true on-policy) and quantized holders keep the loop;
    so do widths whose rows would not be 16-byte aligned."""
    monkeypatch.setattr(moe, "GROUPED_GEMM_DEVICES", ("cuda", "cpu"))
    layer, x, _, _ = _grouped_case()
    assert moe.grouped_gemm_applies(layer, x)
    assert not moe.grouped_gemm_applies(Experts(4, 16, 6), torch.randn(3, 16, dtype=torch.bfloat16))  # 6 * 2 bytes
    layer.lora_hooks["down_proj"] = lambda: None
    assert not moe.grouped_gemm_applies(layer, x)
    layer.lora_hooks.clear()
    with invariant.kernels():
        assert not moe.grouped_gemm_applies(layer, x)
    monkeypatch.setattr(layer, "held_quantized", True)
    assert not moe.grouped_gemm_applies(layer, x)


def test_fixed_order_sum_is_cpu_index_adds_bits():
    # CUDA runs sum_in_expert_order instead of index_add_ (atomics: run-to-run bits); on the CPU both
    # add each token's contributions to 0 in ascending expert order, so the bits must be the same.
    torch.manual_seed(0)
    experts = torch.stack([torch.randperm(8)[:3] for _ in range(40)])
    order = experts.reshape(-1).argsort(stable=True)
    y = torch.randn(120, 16) * torch.logspace(-6, 6, 16)  # wide magnitudes: the order shows in the bits
    expected = torch.zeros(40, 16).index_add_(0, order // 3, y)
    assert torch.equal(sum_in_expert_order(y, order, experts), expected)
    shuffled = torch.zeros(40, 16).index_add_(0, (order // 3).flip(0), y.flip(0))
    assert not torch.equal(shuffled, expected)  # the control: another order gives other bits


def test_shared_expert_gated_and_plain():
    plain = _randomized_moe(num_shared_experts=1)
    assert hasattr(plain, "shared_experts") and plain.shared_expert_gate is None
    gated = _randomized_moe(shared_expert_intermediate_size=12, shared_expert_gate=True)
    assert gated.shared_expert.gate_proj.weight.shape == (12, 16)
    x = torch.randn(1, 3, 16)
    routed = gated.experts(x.reshape(-1, 16), *gated.gate(x.reshape(-1, 16)))
    shared = torch.sigmoid(gated.shared_expert_gate(x)) * gated.shared_expert(x)
    torch.testing.assert_close(gated(x), routed.view(1, 3, 16) + shared)


def _model(**moe_kw) -> CausalLM:
    model = CausalLM(_arch(**moe_kw), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    return model.eval()


@pytest.mark.parametrize("moe_kw", [{}, dict(scoring="sigmoid", score_correction_bias=True, n_group=3, topk_group=2,
                                             num_shared_experts=1, routed_scaling_factor=2.0)])
def test_routing_record_and_replay(moe_kw):
    model = _model(**moe_kw)
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(3))
    record = {}
    logits = model(ids, routing_record=record)
    assert sorted(record) == [0, 1] and record[0].shape == (2, 7, 2)
    # replaying the recorded routing reproduces the forward bitwise
    assert torch.equal(model(ids, routing_replay=record), logits)
    # another routing changes it, and the router still gets gradients through the weights
    other = {layer: (e + 1) % 6 for layer, e in record.items()}
    replayed_record = {}
    out = model(ids, routing_replay=other, routing_record=replayed_record)
    assert not torch.allclose(out, logits)
    assert all(torch.equal(replayed_record[k], other[k]) for k in other)
    out.sum().backward()
    assert model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_fuse_and_split_experts_round_trip():
    fused = {"model.layers.0.mlp.experts.gate_up_proj": torch.randn(3, 8, 5),
             "model.layers.0.mlp.experts.down_proj": torch.randn(3, 5, 4), "model.norm.weight": torch.ones(5)}
    split = split_experts(fused)
    assert split["model.layers.0.mlp.experts.2.up_proj.weight"].shape == (4, 5)
    assert torch.equal(split["model.layers.0.mlp.experts.1.gate_proj.weight"], fused["model.layers.0.mlp.experts.gate_up_proj"][1, :4])
    back = fuse_experts(split)
    assert back.keys() == fused.keys() and all(torch.equal(back[k], fused[k]) for k in fused)
    assert fuse_experts(fused).keys() == fused.keys()  # already fused: unchanged
    del split["model.layers.0.mlp.experts.1.down_proj.weight"]
    with pytest.raises(ValueError, match="incomplete"):
        fuse_experts(split)


def test_idle_params():
    arch = _arch(num_shared_experts=1)
    total, active = param_count(arch)
    per_expert = 3 * 16 * 8
    assert total - active == arch.num_layers * (6 - 2) * per_expert


def test_router_runs_in_float32_under_autocast():
    layer = _randomized_moe(scoring="sigmoid", score_correction_bias=True)
    x = torch.randn(12, 16)
    experts, weights = layer.gate(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        experts_ac, weights_ac = layer.gate(x)
        assert layer(x[None], None).dtype == torch.float32  # fp32 weights: output keeps the input dtype
    assert weights_ac.dtype == torch.float32
    assert torch.equal(experts_ac, experts) and torch.equal(weights_ac, weights)
