"""The FP8 / INT4 engines' MoE experts held quantized (miles/models/quant_experts.py) and the grouped
kernels reading them (miles/models/moe_grouped.py's `Stack`), against the dense values they replace.

- the kernels on FP8 codes / packed INT4 give the bits of the same kernels on the dequantized stacks
  (several 128-blocks and INT4 groups, widths that are not multiples of the tiles, an odd INT4 K);
- an engine holds the codes and scales weight sync sends (bytes by hand), decodes what an engine
  holding the dequantized stacks decodes (bit for bit: the expert loop multiplies the same slices),
  through the grouped kernels in slot decode as well (the interpreter), and takes a sync in place
  under the trainer's device checksum.

The kernels run on the CPU under the Triton interpreter (a subprocess), compiled on CUDA (tests/gpu
runs this file).
"""

import os
from dataclasses import replace

import pytest
import torch

from triton_interpreter import run_under_interpreter

from miles.config.schema import AlgoCfg, AlgoName, DType, LoRACfg, ModelCfg, PrecisionCfg, Quant, RolloutCfg, TrainerCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import moe_grouped as mg
from miles.models.config import MoEConfig
from miles.models.moe import Experts
from miles.models.quant_experts import EngineQuantExperts
from miles.orchestrate.checkpoints import random_checkpoint
from miles.precision.rollout_format import from_rollout_format, rollout_format
from miles.rollout.native import NativeEngine
from miles.trainer.torch_trainer import TorchTrainer
from miles.transport.flat import tensors_checksum

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CHILD = os.environ.get("TRITON_INTERPRET") == "1"
RUNS_KERNEL = mg.triton is not None and (DEV == "cuda" or (CHILD and mg._interpreting()))
needs_kernel = pytest.mark.skipif(not RUNS_KERNEL, reason="kernel tests run on CUDA or in the interpreter subprocess")
parent_only = pytest.mark.skipif(CHILD, reason="runs in the parent (no kernel)")

E, H, I = 4, 128, 128  # whole 128-blocks and INT4 groups: the rounding is real
MODEL = ModelCfg(name="m", family="qwen3_moe", hidden_size=H, intermediate_size=256, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=32, max_position_embeddings=64,
                 moe=MoEConfig(num_experts=E, num_experts_per_tok=2, moe_intermediate_size=I))


def recipe(quant: str) -> PrecisionCfg:
    """fp8 / int4_qat as conf/precision ships them (bf16 on both sides)."""
    return PrecisionCfg(name={"fp8": "fp8", "int4": "int4_qat"}[quant], train_dtype=DType.bf16,
                        rollout_dtype=DType.bf16, train_quant=Quant(quant), rollout_quant=Quant(quant))


def trainer(ckpt, quant):
    return TorchTrainer(ckpt, AlgoCfg(name=AlgoName.grpo), TrainerCfg(global_batch_size=4, micro_batch_size=4,
                                                                     lora=LoRACfg()), recipe(quant))


@pytest.mark.skipif(DEV != "cpu" or CHILD or mg.triton is None, reason="only the CPU parent starts it")
def test_kernels_under_interpreter():
    run_under_interpreter(__file__)


# ------------------------------------------------------------------------------- kernels
def _stacks(e, h, i, fmt, group, dtype, seed=0):
    """(quantized Stack operands, the dense stacks they dequantize to in `dtype`) of random experts."""
    ex = Experts(e, h, i)
    ex.init_weights(torch.Generator().manual_seed(seed))
    weights = {"gate_up_proj": ex.gate_up_proj.detach(), "down_proj": ex.down_proj.detach()}
    payload = rollout_format(weights, fmt, lambda _: False, group)
    dense = from_rollout_format(payload, fmt, dtype, group)
    payload = {k: v.to(DEV) for k, v in payload.items()}
    if fmt == "fp8":
        quant = [mg.Stack(payload[n], payload[n + "_scale_inv"], "fp8") for n in weights]
    else:
        quant = [mg.Stack(payload[n + "_packed"], payload[n + "_scale"], "int4", group) for n in weights]
    return quant, [dense[n].to(DEV) for n in weights]


# (tokens, k, experts, hidden, expert width, INT4 group): two 128-blocks each way with partial last ones
# (FP8; the up half starting mid-tile: its scales per weight, the rest a scale a tile), INT4 groups of
# 128 (scales a row a tile) and of 32 (per weight), an odd K of the down projection (INT4: its last byte
# half used), 64 tokens.
CASES = [(5, 2, 4, 160, 136, 128), (9, 3, 6, 48, 41, 32), (64, 8, 16, 64, 24, 32)]


@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
@pytest.mark.parametrize("n,k,e,h,i,group,dtype,block_k",
                         [(*case, torch.bfloat16, bk) for case in CASES for bk in (64, 128)]
                         # fp32: the IEEE dots (the interpreter's time is the cost), at fp32's K tile: at 128
                         # FP8's per-weight scales take more shared memory than an H100's 227 KB
                         + [(*CASES[0], torch.float32, 64)])
def test_quantized_stacks_give_the_bits_of_the_dequantized_ones(n, k, e, h, i, group, dtype, block_k, fmt):
    """The same kernels on the codes and on the dequantized stacks: only the dequantization in registers
    can differ. K tiles of 64 and 128 (an INT4 group of 32 spans several groups a tile: scales per weight)."""
    quant, dense = _stacks(e, h, i, fmt, group, dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, h, generator=g).to(dtype=dtype, device=DEV)
    experts = torch.rand(n, e, generator=g).topk(k, dim=-1).indices.to(DEV)
    weights = torch.rand(n, k, generator=g).to(DEV)
    with torch.no_grad():
        out = mg.grouped_experts(x, experts, weights, *quant, block_k=block_k)
        ref = mg.grouped_experts(x, experts, weights, *dense, block_k=block_k)
    assert out.dtype == dtype and torch.equal(out, ref)


# ------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(random_checkpoint(MODEL, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp("quant_experts")))


PROMPTS = ["1+2=", "35+47=", "9*9="]


def _engine(ckpt, quant, dense_experts=False, monkeypatch=None, **rollout):
    cfg = RolloutCfg(max_new_tokens=5, max_prompt_len=8, max_running=4, **rollout)
    if not dense_experts:
        return NativeEngine(ckpt, cfg, DType.bf16, seed=0, precision=recipe(quant), device=DEV)
    with monkeypatch.context() as m:  # the engine before its experts were held quantized: the dequantized stacks
        m.setattr("miles.rollout.native.quantize_engine_experts", lambda model, recipe: None)
        return NativeEngine(ckpt, cfg, DType.bf16, seed=0, precision=recipe(quant), device=DEV)


def _generate(engine):
    return engine.generate(PROMPTS, ["?"] * 3, n=2, temperature=0.0)


@parent_only
@pytest.mark.parametrize("quant,expected_bytes", [
    ("fp8", E * (2 * I * H + H * I) + 4 * E * (2 * 1 + 1)),  # 1 byte a weight + a scale per 128x128 block
    ("int4", E * (2 * I * H + H * I) // 2 + 4 * E * (2 * I + H) * 1),  # a nibble + a scale per group of 128
])
def test_the_engine_holds_the_payloads_codes_and_decodes_as_the_dequantized_stacks(ckpt, quant, expected_bytes,
                                                                                   monkeypatch):
    engine = _engine(ckpt, quant)
    held = [layer.mlp.experts for layer in engine.model.layers]
    assert all(isinstance(ex, EngineQuantExperts) for ex in held)
    assert all(ex.held_bytes() == expected_bytes for ex in held)
    dense = _engine(ckpt, quant, dense_experts=True, monkeypatch=monkeypatch)
    assert type(dense.model.layers[0].mlp.experts) is Experts
    assert torch.equal(held[0].expert_weight("down_proj", 2), dense.model.layers[0].mlp.experts.down_proj[2])
    a, b = _generate(engine), _generate(dense)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.rollout_logprobs for s in a] == [s.rollout_logprobs for s in b]


@parent_only
def test_with_the_codes_kernels_off_the_holders_keep_the_expert_loop(ckpt, monkeypatch):
    from miles.models.moe import graph_capturable

    engine = _engine(ckpt, "fp8")
    held = engine.model.layers[0].mlp.experts
    assert mg.grouped_stacks(held) is not None and graph_capturable(engine.model) == (mg.triton is not None)
    monkeypatch.setattr(mg, "CODES_ON_CUDA", False)
    assert mg.grouped_stacks(held) is None and not graph_capturable(engine.model)


@parent_only
def test_kept_experts_stay_dense():
    from miles.precision.recipe import Recipe

    cfg = replace(recipe("fp8"), keep_high_precision=["experts.down_proj"])
    r = Recipe.from_cfg(cfg, 2)
    assert not r.holds_stacks_quantized("model.layers.0.mlp.experts")
    assert Recipe.from_cfg(recipe("fp8"), 2).holds_stacks_quantized("model.layers.0.mlp.experts")


@parent_only
@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_a_sync_lands_in_place_under_the_trainers_checksums(ckpt, quant):
    t = trainer(ckpt, quant)
    engine = _engine(ckpt, quant)
    held = engine.model.layers[1].mlp.experts
    code = held.gate_up_proj if quant == "fp8" else held.gate_up_proj_packed
    address = code.data_ptr()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g).to(p.device))  # other weights, other codes
    payload, expected = t._weights_of(t._policy_state())  # rollout format + its (host) checksum
    before = code.clone()
    assert engine.update_weights(payload, expected) == expected
    assert code.data_ptr() == address and not torch.equal(code, before)  # in place: graphs keep their buffers
    device_expected = tensors_checksum(t.recipe.expected_tensors(payload, t.model, torch.bfloat16))
    assert engine.update_weights(payload, device_expected) == device_expected  # the in-process path's check


@needs_kernel
@pytest.mark.parametrize("quant", ["fp8", "int4"])
def test_slot_decode_reads_the_codes_through_the_grouped_kernels(ckpt, quant, monkeypatch):
    """Slot decode with MoE.forward dispatching to the grouped kernels on the held codes (forced in the
    interpreter: `applies` wants CUDA): the padded engine's expert loop's tokens and log-probs."""
    calls = []
    grouped = mg.grouped_experts
    monkeypatch.setattr(mg, "applies", lambda experts, x, ctx: getattr(ctx, "slot_decode", False))
    monkeypatch.setattr(mg, "grouped_experts",
                        lambda x, e, w, gu, d, **kw: calls.append(isinstance(gu, mg.Stack)) or grouped(x, e, w, gu, d, **kw))
    slot, padded = (_engine(ckpt, quant, slot_decode=s, sync_every=2) for s in (True, False))
    a, b = _generate(slot), _generate(padded)
    assert calls and all(calls)  # every slot step read the quantized stacks
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for s, t in zip(a, b):
        assert max(abs(x - y) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-2
