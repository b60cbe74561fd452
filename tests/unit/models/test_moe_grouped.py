"""The graph-capturable MoE experts (miles/models/moe_grouped.py) against `Experts.forward`'s loop.

The block layout is plain torch and runs here directly; the Triton kernels run on the CPU through the
Triton interpreter (a subprocess with TRITON_INTERPRET=1: triton picks interpreting or compiling at
import), on a CUDA machine compiled. tests/gpu/test_moe_graph_decode_cuda.py runs them at Qwen3-30B-A3B
and DeepSeek-V3 widths and in captured slot decode.
"""

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from triton_interpreter import run_under_interpreter

from miles.config.schema import LoRACfg, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import CausalLM, invariant, moe_grouped as mg
from miles.models.context import ForwardContext
from miles.models.moe import Experts, graph_capturable
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_KERNEL = mg.triton is not None and (DEV == "cuda" or (CHILD and mg._interpreting()))
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="kernel tests run on CUDA or in the interpreter subprocess")
parent_only = pytest.mark.skipif(CHILD, reason="runs in the parent (no kernel)")
CONF = Path(__file__).resolve().parents[3] / "conf" / "model"


@pytest.mark.skipif(DEV != "cpu" or CHILD or mg.triton is None, reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


def _choices(n, k, num_experts, kind, seed=0):
    """[n, k] distinct experts per token: random top-k, only the first half of the experts, or every
    token on the same experts (one expert takes every token when k = 1)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "same":
        return torch.arange(3, 3 + k).repeat(n, 1) % num_experts
    pool = num_experts // 2 if kind == "half" else num_experts
    return torch.rand(n, pool, generator=g).topk(k, dim=-1).indices


# ------------------------------------------------------------------------------- block layout (torch)
def _check_layout(experts, e, block_m):
    n, k = experts.shape
    pairs, block_expert = mg.block_layout(experts, e, block_m=block_m)
    blocks = mg.max_blocks(n * k, e, block_m)
    assert pairs.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    assert pairs.dtype == block_expert.dtype == torch.int32
    flat = experts.reshape(-1)
    real = pairs[pairs >= 0].long()
    assert torch.equal(real.sort().values, torch.arange(n * k))  # every pair exactly once
    by_block = pairs.view(blocks, block_m).long()
    used = block_expert >= 0
    # Used blocks first, experts ascending; each block holds its expert's pairs in (token, slot) order.
    assert used.long().diff().le(0).all() and block_expert[used].diff().ge(0).all()
    for j in range(blocks):
        rows = by_block[j][by_block[j] >= 0]
        if block_expert[j] < 0:
            assert rows.numel() == 0
            continue
        assert rows.numel() > 0 and (flat[rows] == block_expert[j]).all() and rows.diff().gt(0).all()
    counts = torch.bincount(flat, minlength=e)
    assert used.sum() == (-(-counts // block_m)).sum()  # runs padded to the block, no more
    assert set(block_expert[used].tolist()) == set(flat.tolist())  # experts nobody chose get no block


@parent_only
@pytest.mark.parametrize("n,k,e,kind", [(1, 8, 128, "random"), (64, 8, 64, "random"), (64, 8, 128, "random"),
                                        (5, 2, 8, "half"), (33, 1, 8, "same"), (7, 3, 6, "same"), (16, 4, 4, "random")])
def test_block_layout_puts_every_pair_once_in_blocks_of_its_expert(n, k, e, kind):
    _check_layout(_choices(n, k, e, kind), e, 16)


@parent_only
def test_block_layout_on_random_shapes_and_block_sizes():
    g = torch.Generator().manual_seed(0)
    for _ in range(40):
        e = int(torch.randint(1, 40, (1,), generator=g))
        n, k = int(torch.randint(1, 50, (1,), generator=g)), int(torch.randint(1, e + 1, (1,), generator=g))
        skew = torch.rand(e, generator=g) ** 4  # some experts popular, some never chosen
        experts = (torch.rand(n, e, generator=g) * skew).topk(k, dim=-1).indices
        _check_layout(experts, e, int(torch.tensor([1, 4, 16])[torch.randint(0, 3, (1,), generator=g)]))


@parent_only
def test_max_blocks_is_reached_when_every_pair_has_its_own_expert():
    experts = torch.arange(8)[None]  # one token, k = 8: eight runs of one pair, each padded to a block
    pairs, block_expert = mg.block_layout(experts, 128, block_m=16)
    assert block_expert.tolist() == list(range(8)) == list(range(mg.max_blocks(8, 128, 16)))
    assert mg.max_blocks(64 * 8, 128, 16) == -(-(512 + 128 * 15) // 16)


# ------------------------------------------------------------------------------- dispatch
def _experts(e, h, i, dtype, seed=0):
    ex = Experts(e, h, i)
    ex.init_weights(torch.Generator().manual_seed(seed))
    return ex.to(dtype=dtype, device=DEV)


def _slot_ctx(rows):
    return ForwardContext(position_ids=torch.zeros(rows, 1, dtype=torch.long), attention_mask=None,
                          past=torch.zeros(rows, dtype=torch.long))


@parent_only
def test_the_grouped_path_is_chosen_only_for_plain_experts_in_slot_decode_on_cuda():
    ex, x = _experts(8, 32, 16, torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16)
    slot, padded = _slot_ctx(4), ForwardContext(position_ids=torch.zeros(4, 1, dtype=torch.long), attention_mask=None,
                                                 past=3)
    assert not mg.applies(ex, x, slot)  # a CPU tensor
    cuda_x = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda"))  # no GPU needed
    assert mg.applies(ex, cuda_x, slot) == (mg.triton is not None)
    assert not mg.applies(ex, cuda_x, padded) and not mg.applies(ex, cuda_x, None)
    assert not mg.applies(ex, SimpleNamespace(**{**vars(cuda_x), "dtype": torch.float32}), slot)  # another dtype
    with invariant.kernels():  # true on-policy: the trainer's expert loop
        assert not mg.applies(ex, cuda_x, slot)
    ex.lora_hooks["down_proj"] = lambda: lambda e, a, y, rows, total: y
    assert not mg.applies(ex, cuda_x, slot)  # hooks run per expert on its own tokens
    ex.lora_hooks.clear()
    ex.held_quantized = True  # QLoRA's holder: no stacked dense tensors to multiply
    assert not mg.applies(ex, cuda_x, slot)


def _model_cfg(name: str) -> ModelCfg:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelCfg), OmegaConf.load(CONF / f"{name}.yaml")))


@parent_only
@pytest.mark.skipif(mg.triton is None, reason="needs triton")
def test_a_model_is_capturable_unless_an_moe_layer_keeps_the_loop():
    model = CausalLM(_model_cfg("deepseek_v3_tiny").arch(32))  # a dense first layer, then MoE
    assert graph_capturable(model)
    with invariant.kernels():
        assert not graph_capturable(model)
    model.layers[1].mlp.experts.lora_hooks["gate_up_proj"] = lambda e, x, y, rows, total: y
    assert not graph_capturable(model)
    assert not graph_capturable(CausalLM(_model_cfg("llama4_tiny").arch(32)))  # Llama 4's experts: the loop


@parent_only
@pytest.mark.skipif(mg.triton is None, reason="needs triton")
def test_the_engine_captures_moe_slot_steps_unless_experts_carry_lora_hooks(tmp_path):
    ckpt = str(random_checkpoint(_model_cfg("qwen3_moe_tiny"), DEFAULT_ALPHABET, 0, tmp_path / "m"))
    cfg = RolloutCfg(max_new_tokens=4, max_prompt_len=8, max_running=4, slot_decode=True)
    build = lambda lora=None, **kw: NativeEngine(ckpt, replace(cfg, **kw), seed=0, lora=lora)  # noqa: E731
    assert build()._slot_graphs() and not build(cuda_graphs=False)._slot_graphs()
    assert build(LoRACfg(rank=4))._slot_graphs()  # the default targets: projections, not the stacked experts
    assert not build(LoRACfg(rank=4, target_modules=["q_proj", "experts"]))._slot_graphs()  # hooked experts: the loop


# ------------------------------------------------------------------------------- kernels
# (tokens, k, experts, hidden, expert width, choice): experts nobody chose, every token on the same
# experts (one expert takes all at k = 1), one token, 64 tokens with k = 8 of 64 / 128 experts; widths
# that are not multiples of the 16-row block nor of the tiles.
CASES = [(5, 2, 8, 40, 24, "half"), (33, 1, 8, 48, 40, "same"), (9, 3, 6, 32, 16, "same"),
         (1, 8, 128, 40, 24, "random"), (64, 8, 64, 48, 24, "random"), (64, 8, 128, 32, 16, "random")]


def _run(n, k, e, h, i, kind, dtype, seed=0, **tiles):
    ex = _experts(e, h, i, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, h, generator=g).to(dtype=dtype, device=DEV)
    experts = _choices(n, k, e, kind, seed).to(DEV)
    weights = torch.rand(n, k, generator=g).to(DEV)
    with torch.no_grad():
        out = mg.grouped_experts(x, experts, weights, ex.gate_up_proj, ex.down_proj, **tiles)
        ref = ex(x, experts, weights)
    return out, ref


def _rel(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@needs_kernel
@pytest.mark.parametrize("n,k,e,h,i,kind", CASES)
def test_fp32_equals_the_expert_loop(n, k, e, h, i, kind):
    out, ref = _run(n, k, e, h, i, kind, torch.float32)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel(out, ref) <= 1e-5


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,e,h,i,kind", CASES)
def test_half_precision_within_a_rounding_of_the_expert_loop(n, k, e, h, i, kind, dtype):
    out, ref = _run(n, k, e, h, i, kind, dtype)
    assert out.dtype == dtype
    # The same roundings as the loop; the GEMMs' fp32 sums in another order can move a rounding by one unit.
    assert _rel(out, ref) <= (1e-2 if dtype == torch.bfloat16 else 2e-3)


@needs_kernel
def test_tiles_that_split_hidden_and_width_give_the_same_sums_within_rounding():
    out, ref = _run(6, 2, 8, 80, 48, "random", torch.float32, block_n=16, block_k=32)
    assert _rel(out, ref) <= 1e-5


@needs_kernel
def test_runs_repeat_bit_for_bit():
    a, _ = _run(64, 8, 64, 48, 24, "random", torch.bfloat16)
    b, _ = _run(64, 8, 64, 48, 24, "random", torch.bfloat16)
    assert torch.equal(a, b)


@needs_kernel
@pytest.mark.parametrize("model", ["qwen3_moe_tiny", "deepseek_v3_tiny", "glm4_moe_tiny", "minimax_m2_tiny"])
def test_slot_decode_through_the_grouped_path_equals_the_padded_engine(tmp_path, monkeypatch, model):
    """MoE tinies (softmax / sigmoid routers, expert groups, shared experts, routed scaling; GQA and MLA)
    decode in slots with MoE.forward dispatching to the grouped kernels (forced in the interpreter:
    `applies` wants CUDA; on a GPU the engines run on it) and record their routing: the same greedy
    tokens, log-probs and routed experts as the padded engine's expert loop."""
    calls = []
    grouped = mg.grouped_experts
    monkeypatch.setattr(mg, "applies", lambda experts, x, ctx: getattr(ctx, "slot_decode", False))
    monkeypatch.setattr(mg, "grouped_experts", lambda *a, **kw: calls.append(1) or grouped(*a, **kw))
    ckpt = str(random_checkpoint(_model_cfg(model), DEFAULT_ALPHABET, 0, tmp_path / "m"))
    cfg = RolloutCfg(max_new_tokens=5, max_prompt_len=8, max_running=4, sync_every=2)
    engines = [NativeEngine(ckpt, replace(cfg, slot_decode=slot), seed=0, record_routing=True, device=DEV)
               for slot in (True, False)]
    prompts = ["1+2=", "35+47=", "9*9="]
    a, b = (e.generate(prompts, ["?"] * 3, n=2, temperature=0.0) for e in engines)
    assert calls  # the slot steps went through the kernels
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for s, t in zip(a, b):
        assert max(abs(x - y) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-5
        assert torch.equal(s.routed_experts, t.routed_experts)
