"""MoE decode in CUDA graphs: the grouped expert kernels (miles/models/moe_grouped.py) against the expert
loop at Qwen3-30B-A3B and DeepSeek-V3 widths, and a small MoE model's slot decode captured in graphs
against eager slot decode and the padded engine, with routing records and a weight update.

The kernels' logic ran on the CPU through the Triton interpreter (tests/unit/models/test_moe_grouped.py).
Skipped without a GPU.
"""


import pytest
import torch

from miles.config.schema import DType, ModelCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained, moe_grouped
from miles.models.config import MoEConfig
from miles.models.moe import Experts, route
from miles.orchestrate.checkpoints import random_checkpoint
from miles.types import moe_layers, stack_routing
from gpu_runs import captured, max_lp_diff, responses, slot_engines

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
QWEN3_30B_A3B = MoEConfig(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
DEEPSEEK_V3 = MoEConfig(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, scoring="sigmoid",
                        score_correction_bias=True, n_group=8, topk_group=4, routed_scaling_factor=2.5)
# A small Qwen3-MoE: every layer MoE, 16 experts of which 4 per token.
SMALL_MOE = ModelCfg(name="qwen3_moe_small", family="qwen3_moe", hidden_size=256, intermediate_size=768, num_layers=4,
                     num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=256,
                     moe=MoEConfig(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128))


def _case(moe: MoEConfig, hidden: int, rows: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.device("meta"):  # made in `dtype` on the GPU: DeepSeek-V3's stack in fp32 would take 90 GB
        experts = Experts(moe.num_experts, hidden, moe.moe_intermediate_size).to(dtype)
    experts = experts.to_empty(device="cuda")
    experts.init_weights(gen)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(dtype)
    logits = torch.randn(rows, moe.num_experts, device="cuda", generator=gen)
    bias = torch.randn(moe.num_experts, device="cuda", generator=gen) * 0.1 if moe.score_correction_bias else None
    chosen, weights = route(logits, moe, bias)
    return experts, x, chosen, weights


def _rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("rows", [1, 64, 256])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_grouped_equals_the_expert_loop_at_qwen3_30b_a3b_widths(rows, dtype, tol):
    experts, x, chosen, weights = _case(QWEN3_30B_A3B, 2048, rows, dtype)
    with torch.no_grad():
        out = moe_grouped.grouped_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj)
        ref = experts(x, chosen, weights)
    print(f"\nE=128 k=8 rows={rows} {dtype}: {_rel(out, ref):.2e}")
    assert _rel(out, ref) <= tol


@pytest.mark.parametrize("rows", [1, 64])
def test_grouped_equals_the_expert_loop_at_deepseek_v3_widths(rows):
    experts, x, chosen, weights = _case(DEEPSEEK_V3, 7168, rows, torch.bfloat16)
    with torch.no_grad():
        out = moe_grouped.grouped_experts(x, chosen, weights, experts.gate_up_proj, experts.down_proj)
        ref = experts(x, chosen, weights)
    print(f"\nE=256 k=8 groups rows={rows} bf16: {_rel(out, ref):.2e}")
    assert _rel(out, ref) <= 1e-2


def test_a_captured_call_replays_new_inputs_bit_for_bit():
    experts, x, chosen, weights = _case(QWEN3_30B_A3B, 2048, 64, torch.bfloat16)
    buffers = [x.clone(), chosen.clone(), weights.clone()]
    call = lambda: moe_grouped.grouped_experts(*buffers, experts.gate_up_proj, experts.down_proj)  # noqa: E731
    with torch.no_grad():
        graph, out = captured(call)
        _, x2, chosen2, weights2 = _case(QWEN3_30B_A3B, 2048, 64, torch.bfloat16, seed=1)  # other routes
        for buffer, new in zip(buffers, (x2, chosen2, weights2)):
            buffer.copy_(new)
        graph.replay()
        assert torch.equal(out, call())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(random_checkpoint(SMALL_MOE, DEFAULT_ALPHABET, seed=0, out=tmp_path_factory.mktemp("ckpt") / "m"))


def engines(checkpoint, dtype, record_routing=False, **overrides):
    return slot_engines(checkpoint, dtype, {"record_routing": record_routing}, **overrides)


@pytest.mark.parametrize("dtype", [DType.fp32, DType.bf16])
def test_moe_graph_decode_equals_eager_slot_decode(checkpoint, dtype):
    graphs, eager, _ = engines(checkpoint, dtype)
    assert graphs.slots.captured and not eager.slots.captured
    a, b = responses(graphs), responses(eager)  # 48 samples over 24 slots: refills and compaction
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max_lp_diff(a, b) == 0.0  # the same kernels, replayed


def test_moe_graph_decode_matches_the_padded_engine(checkpoint):
    from gpu_runs import full_forward_mismatch

    graphs, _, padded = engines(checkpoint, DType.fp32)
    a, b = responses(graphs), responses(padded)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max_lp_diff(a, b) < 1e-4
    graphs, _, padded = engines(checkpoint, DType.bf16)
    a, b = responses(graphs), responses(padded)
    same = sum(s.response_ids == t.response_ids for s, t in zip(a, b))
    print(f"\nbf16 greedy responses equal to the padded engine's: {same} / {len(a)}")
    assert same >= len(a) - 4  # the grouped GEMMs' other fp32 order can flip a bf16 near-tie
    assert full_forward_mismatch(responses(graphs, n=2, temperature=1.0), checkpoint, graphs.dtype) < 5e-2


def test_captured_steps_record_the_routing_of_the_full_forward(checkpoint):
    graphs, eager, _ = engines(checkpoint, DType.fp32, record_routing=True)
    assert graphs.slots.captured
    a, b = responses(graphs, n=2, temperature=1.0), responses(eager, n=2, temperature=1.0)
    layers = moe_layers(graphs.model.config)
    for s, t in zip(a, b):
        assert s.response_ids == t.response_ids and torch.equal(s.routed_experts, t.routed_experts)
        ids = torch.tensor([s.prompt_ids + s.response_ids], device="cuda")[:, :-1]
        record: dict = {}
        with torch.no_grad():
            graphs.model(ids, routing_record=record)
        full = stack_routing(record, layers, s.routed_experts.dtype)[0].cpu()
        assert (full == s.routed_experts).float().mean() > 0.99  # fp32 near-ties of the router aside


def test_graph_replay_after_a_weight_update_uses_the_new_weights(checkpoint, tmp_path):
    graphs, _, padded = engines(checkpoint, DType.fp32)
    before = responses(graphs, n=1)
    other = str(random_checkpoint(SMALL_MOE, DEFAULT_ALPHABET, seed=1, out=tmp_path / "m1"))
    new = from_pretrained(other, dtype=torch.float32).state_dict()
    for engine in (graphs, padded):
        engine.update_weights(new)
    assert graphs.slots.captured  # in place: the same graphs
    a, b = responses(graphs, n=1), responses(padded, n=1)
    assert [s.response_ids for s in a] != [s.response_ids for s in before]
    assert [s.response_ids for s in a] == [s.response_ids for s in b] and max_lp_diff(a, b) < 1e-4
