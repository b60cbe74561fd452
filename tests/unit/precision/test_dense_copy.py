"""Dense copies of weight-only engine layers (`rollout.dense_weight_copies`, miles/precision/dense_copy.py):
calls of many rows multiply the copy and get the weight-only path's bits; small calls keep the
payload's kernels; a sync refreshes the copy in place; an engine with copies samples what one
without them samples, across a dropping release, resume and sync; the memory plan counts them.
(Joined copies under fused projections: tests/unit/models/test_fused_projections.py.)"""

import copy
from dataclasses import replace

import pytest
import torch

from miles.config.schema import FP8Scheme, ModelCfg, PrecisionCfg, Quant, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import from_pretrained
from miles.orchestrate.checkpoints import random_checkpoint
from miles.precision import dense_copy
from miles.precision.recipe import QuantLinear, Recipe
from miles.rollout.native import NativeEngine

WEIGHT_ONLY = [("fp8", "w8a16"), ("int4", "w8a8")]


def recipe(quant: str, scheme: str) -> Recipe:
    cfg = PrecisionCfg(name=quant, train_quant=Quant(quant), rollout_quant=Quant(quant), fp8_scheme=FP8Scheme(scheme),
                       int4_group_size=32)
    return Recipe.from_cfg(cfg, 1)


def layers(quant: str, scheme: str, weight: torch.Tensor):
    """(the engine layer without a copy, the same with one), loaded from `weight`'s payload."""
    r = recipe(quant, scheme)
    made = []
    for dense in (False, True):
        model = torch.nn.Sequential(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=True))
        model[0].weight.data = weight.clone()
        model[0].bias.data.uniform_(-1, 1, generator=torch.Generator().manual_seed(5))
        payload = r.sync_payload(model.state_dict())
        r.prepare_engine(model)
        r.load_engine(model, payload, torch.float32)
        if dense:
            model[0].hold_dense_copy(torch.float32)
        made.append(model)
    return r, made


@pytest.mark.parametrize("quant,scheme", WEIGHT_ONLY)
def test_many_rows_multiply_the_copy_and_get_the_payload_paths_bits(quant, scheme):
    gen = torch.Generator().manual_seed(0)
    _, (plain, held) = layers(quant, scheme, torch.randn(192, 320, generator=gen))
    assert isinstance(held[0], QuantLinear) and held[0].dense.shape == (192, 320)
    small, large = torch.randn(8, 320, generator=gen), torch.randn(dense_copy.MIN_ROWS, 320, generator=gen)
    for x in (small, large):
        assert torch.equal(plain(x), held(x))
    held[0].dense.zero_()  # which calls read the copy
    assert torch.equal(held(small), plain(small))
    assert torch.equal(held(large), held[0].bias.expand(len(large), -1))  # a zero weight: the bias alone


@pytest.mark.parametrize("quant,scheme", WEIGHT_ONLY)
def test_a_sync_refreshes_the_copy_in_place(quant, scheme):
    gen = torch.Generator().manual_seed(1)
    r, (plain, held) = layers(quant, scheme, torch.randn(128, 256, generator=gen))
    address = held[0].dense.data_ptr()
    new = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=True))
    payload = r.sync_payload(new.state_dict())
    for model in (plain, held):
        r.load_engine(model, payload, torch.float32)
    x = torch.randn(dense_copy.MIN_ROWS, 256, generator=gen)
    assert held[0].dense.data_ptr() == address and torch.equal(held(x), plain(x))
    assert r.held_checksum(held) == r.held_checksum(plain)  # the checksum covers the payload only


def test_w8a8_layers_hold_no_copy():
    _, (plain, _) = layers("int4", "w8a8", torch.randn(128, 128))
    r = recipe("fp8", "w8a8")
    model = torch.nn.Sequential(torch.nn.Linear(128, 128, bias=True))
    payload = r.sync_payload(model.state_dict())
    r.prepare_engine(model)
    r.load_engine(model, payload, torch.float32)
    with pytest.raises(ValueError, match="weight-only"):
        model[0].hold_dense_copy(torch.float32)


@pytest.mark.parametrize("setting, device, quant, scheme, rows, expected", [
    (None, "cuda", "fp8", "w8a16", 512, True),
    (None, "cuda:0", "int4", "w8a8", 257, True),
    (None, "cuda", "fp8", "w8a16", 256, False),  # decode batches the fused kernels take
    (None, "cpu", "fp8", "w8a16", 512, False),
    (None, "cuda", "fp8", "w8a8", 512, False),  # FP8 x FP8 GEMMs: nothing to dequantize
    (None, "cuda", "none", "w8a8", 512, False),
    (True, "cpu", "int4", "w8a8", 8, True),
    (True, "cuda", "fp8", "w8a8", 512, False),
    (False, "cuda", "fp8", "w8a16", 512, False),
])
def test_when_an_engine_holds_copies(setting, device, quant, scheme, rows, expected):
    assert dense_copy.wanted(setting, device, quant, scheme, rows) == expected


def test_an_engine_with_copies_samples_the_same_across_release_and_sync(tmp_path, monkeypatch):
    monkeypatch.setattr(dense_copy, "MIN_ROWS", 1)  # every call through the copies
    tiny = ModelCfg(name="t", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=16, max_position_embeddings=64)
    ckpt = str(random_checkpoint(tiny, DEFAULT_ALPHABET, seed=0, out=tmp_path / "m"))
    precision = PrecisionCfg(name="fp8", train_quant=Quant.fp8, rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme.w8a16)
    cfg = RolloutCfg(max_new_tokens=6, max_prompt_len=8, max_running=4)
    plain = NativeEngine(ckpt, cfg, seed=0, precision=precision)
    held = NativeEngine(ckpt, replace(cfg, dense_weight_copies=True), seed=0, precision=precision)
    assert sum(isinstance(m, QuantLinear) and m.dense.numel() > 0 for m in held.model.modules()) == 14

    def samples(engine):
        out = engine.generate(["1+2=", "35+47="], ["?", "?"], n=2, seeds=[3, 4])
        return [(s.response_ids, s.rollout_logprobs) for s in out]

    assert samples(held) == samples(plain)
    other = from_pretrained(ckpt)
    for p in other.parameters():
        p.data.mul_(0.75)
    payload = plain.recipe.sync_payload(copy.deepcopy(other).state_dict())
    plain.update_weights(payload)
    held.release_memory(keep_weights=False)  # the copies go too, and come back as zeros
    held.resume_memory()
    held.update_weights(payload)
    assert samples(held) == samples(plain)


def test_the_memory_plan_counts_the_copies(compose):
    from miles.hardware.planner import make_plan

    def rollout_items(*overrides):
        return make_plan(compose(["model=qwen3_4b", "hardware=h100", "precision=fp8", *overrides])).rollout

    # Qwen3-4B's quantized Linears a layer: q, k, v, o, gate, up, down; 36 layers, bf16 copies (2 bytes).
    per_layer = (4096 + 1024 + 1024) * 2560 + 2560 * 4096 + 3 * 9728 * 2560
    assert rollout_items()["dense copies"] == 2 * 36 * per_layer  # auto (the default): 64 x 8 rows, it fits
    assert "dense copies" not in rollout_items("rollout.dense_weight_copies=false")
    assert "dense copies" not in rollout_items("precision.fp8_scheme=w8a8")
    # 32 x 8 rows: the fused kernels'
    assert "dense copies" not in rollout_items("rollout.batch_size=32")


# Two 8-GPU H100 nodes of 16 GB, one GPU per engine: a 4B fp8 engine holds 4.4 GB of payload and 4 GB of
# workspace; with its 7.3 GB of copies it would need 15.7 GB of the 14.4 usable.
TIGHT = ["hardware=h100", "hardware.memory_gb=16", "hardware.num_nodes=2", "rollout.colocate=false",
         "rollout.num_gpus=8", "rollout.num_gpus_per_engine=1"]


@pytest.mark.parametrize("overrides, on", [
    (["hardware=h100"], True),                                   # 4B fp8 w8a16 at 64 x 8 rows fits with them
    (["hardware=h100", "precision=int4_qat"], True),
    (["hardware=h100", "rollout.batch_size=32"], False),         # 256 rows: the fused kernels take them all
    (["hardware=h100", "precision.fp8_scheme=w8a8"], False),     # no weight-only layers
    (["hardware=h100", "true_on_policy=true"], False),           # true on-policy never reads a copy
    (["hardware=cpu"], False),                                   # CUDA only
    (TIGHT, False),                                              # they would not fit: the run goes without
    (["hardware=h100", "rollout.dense_weight_copies=false"], False),
    (["hardware=cpu", "rollout.dense_weight_copies=true"], True),  # an explicit choice stays
])
def test_auto_resolves_to_copies_where_wanted_and_they_fit(compose, overrides, on):
    from miles.hardware.planner import resolve_memory_choices

    resolved = resolve_memory_choices(compose(["model=qwen3_4b", "precision=fp8", *overrides]))
    assert resolved.rollout.dense_weight_copies is on


def test_copies_are_dropped_before_a_run_stops_fitting(compose):
    """Where the 4B fp8 run fits only without the copies, auto plans it without them."""
    from miles.hardware.planner import make_plan

    base = ["model=qwen3_4b", "precision=fp8", *TIGHT]
    plan, with_copies = make_plan(compose(base)), make_plan(compose(base + ["rollout.dense_weight_copies=true"]))
    assert plan.fits and "dense copies" not in plan.rollout
    assert not with_copies.fits and with_copies.rollout["dense copies"] > 7e9
