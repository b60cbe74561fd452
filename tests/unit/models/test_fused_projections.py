"""One GEMM for q / k / v and for gate / up over views of the engine's flat weight buffer
(miles/models/fused_projections.py, rollout.fuse_projections): on the CPU, forced on (the engine turns
it on for CUDA only), against the unfused model: same logits (fp32, reordered sums at most), a sync
into the flat buffer reaching the fused view, and LoRA hooks keeping the unfused path."""

import pytest
import torch

from miles.config.schema import DType, ModelCfg, RolloutCfg
from miles.data.tokenizer import DEFAULT_ALPHABET
from miles.models import fused_projections, from_pretrained
from miles.models.lora import LoRA
from miles.orchestrate.checkpoints import random_checkpoint
from miles.rollout.native import NativeEngine
from miles.transport.flat import FlatWeights

DENSE = ModelCfg(name="d", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=64)
BIASED = ModelCfg(name="b", family="qwen2", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, max_position_embeddings=64, attention_bias=True, qk_norm=False)


@pytest.fixture(scope="module", params=[DENSE, BIASED], ids=["qwen3", "qwen2-bias"])
def ckpt(request, tmp_path_factory):
    return str(random_checkpoint(request.param, DEFAULT_ALPHABET, 0, tmp_path_factory.mktemp(request.param.name)))


def _ids():
    return torch.randint(0, 20, (3, 11), generator=torch.Generator().manual_seed(0))


def test_flat_layout_puts_each_group_together(ckpt):
    model = from_pretrained(ckpt)
    names = list(FlatWeights.adopt(model).layout.names)
    for layer in range(2):
        at = [names.index(f"layers.{layer}.self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")]
        assert at == list(range(at[0], at[0] + 3))
        at = [names.index(f"layers.{layer}.mlp.{p}.weight") for p in ("gate_proj", "up_proj")]
        assert at == [at[0], at[0] + 1]


def test_fused_model_gives_the_unfused_logits_and_follows_a_sync(ckpt):
    plain, model = from_pretrained(ckpt).eval(), from_pretrained(ckpt).eval()
    flat = FlatWeights.adopt(model)
    assert fused_projections.enable(model) == 2 * 2  # q / k / v and gate / up in both layers
    calls = []
    real = torch.nn.functional.linear
    with torch.no_grad(), pytest.MonkeyPatch.context() as m:
        m.setattr(torch.nn.functional, "linear", lambda *a: calls.append(a[1].shape) or real(*a))
        fused = model(_ids())
    assert (64 + 2 * 32, 64) in calls and (2 * 128, 64) in calls  # one GEMM per group
    with torch.no_grad():
        torch.testing.assert_close(fused, plain(_ids()), atol=1e-5, rtol=0)
        # A sync writes the buffer; the group's view reads the new weights.
        other = from_pretrained(ckpt)
        for p in other.parameters():
            p.mul_(1.5)
        new = FlatWeights.like(flat.layout, "cpu")
        new.fill_from(other.state_dict())
        flat.copy_from(new)
        torch.testing.assert_close(model(_ids()), other.eval()(_ids()), atol=1e-5, rtol=0)


def test_adapters_keep_the_unfused_path(ckpt):
    model = from_pretrained(ckpt).eval()
    FlatWeights.adopt(model)
    fused_projections.enable(model)
    lora = LoRA(model, rank=4, alpha=8, target_modules=["q_proj"], seed=0)
    with torch.no_grad():
        for p in lora.lora_B:
            p.normal_(generator=torch.Generator().manual_seed(1))
        adapted = model(_ids())
        lora.enabled = False
        base = model(_ids())
    assert (adapted - base).abs().max() > 1e-3  # the q_proj hook ran: its group was not fused
    assert fused_projections._fused_product([model.layers[0].mlp.gate_proj, model.layers[0].mlp.up_proj]) is not None


def test_engine_decodes_the_same_tokens_fused(ckpt):
    cfg = RolloutCfg(max_new_tokens=8, max_prompt_len=16, max_running=8)
    plain = NativeEngine(ckpt, cfg, DType.fp32, seed=0)
    engine = NativeEngine(ckpt, cfg, DType.fp32, seed=0)
    assert fused_projections.enable(engine.model) == 4
    prompts = ["1+2=", "33+4=", "50+50="]
    a = plain.generate(prompts, ["?"] * 3, n=2, temperature=0.0)
    b = engine.generate(prompts, ["?"] * 3, n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-5


@pytest.mark.parametrize("dense", [False, True], ids=["payload", "dense-copies"])
@pytest.mark.parametrize("quant,scheme", [("int4", "w8a8"), ("fp8", "w8a16")])
def test_weight_only_quantized_groups_join_and_follow_a_sync(tmp_path, monkeypatch, quant, scheme, dense):
    """FP8 w8a16 / INT4 engines: each group's payload joined into one storage (the layers' buffers
    views of it), one weight-only product per group (its reference function on the CPU), the same
    greedy tokens and log-probs within 1e-5; a sync copies into the views. With dense copies
    (rollout.dense_weight_copies, every call taking them here) the copies are joined alike."""
    from miles.config.schema import FP8Scheme, PrecisionCfg, Quant
    from miles.precision import dense_copy
    from miles.precision.recipe import QuantLinear

    monkeypatch.setattr(dense_copy, "MIN_ROWS", 1)

    # k / v of 128 rows: FP8's 128-row scale blocks do not straddle two projections (with 64 they would,
    # and q / k / v would stay three GEMMs while gate / up join).
    model = ModelCfg(name="q", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=4,
                     head_dim=32, max_position_embeddings=64)
    ckpt = str(random_checkpoint(model, DEFAULT_ALPHABET, 0, tmp_path / "m"))
    precision = PrecisionCfg(name=quant, rollout_quant=Quant(quant), fp8_scheme=FP8Scheme(scheme))
    cfg = RolloutCfg(max_new_tokens=8, max_prompt_len=16, max_running=8)
    plain = NativeEngine(ckpt, cfg, DType.fp32, seed=0, precision=precision)
    engine = NativeEngine(ckpt, RolloutCfg(**{**vars(cfg), "dense_weight_copies": dense}), DType.fp32, seed=0,
                          precision=precision)
    assert fused_projections.enable(engine.model) == 0  # the payloads are separate tensors until joined
    assert fused_projections.join_quantized(engine.model) == 4 and fused_projections.enable(engine.model) == 4
    attn = engine.model.layers[0].self_attn
    assert isinstance(attn.q_proj, QuantLinear)
    first = attn.q_proj.buffer_names()[0]
    assert getattr(attn.k_proj, first).untyped_storage().data_ptr() == getattr(attn.q_proj, first).untyped_storage().data_ptr()
    assert ("dense" in attn.q_proj.held_names()) == dense
    if dense:
        assert attn.k_proj.dense.untyped_storage().data_ptr() == attn.q_proj.dense.untyped_storage().data_ptr()
    prompts = ["1+2=", "33+4=", "50+50="]
    a = plain.generate(prompts, ["?"] * 3, n=2, temperature=0.0)
    b = engine.generate(prompts, ["?"] * 3, n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.rollout_logprobs, t.rollout_logprobs)) < 1e-5
    # A sync (the trainer's payload of other weights) lands in the joined storage.
    other = from_pretrained(ckpt)
    for p in other.parameters():
        p.data.mul_(1.25)
    payload = plain.recipe.sync_payload(other.state_dict())
    for e in (plain, engine):
        e.update_weights(payload)
    assert getattr(attn.k_proj, first).untyped_storage().data_ptr() == getattr(attn.q_proj, first).untyped_storage().data_ptr()
    a = plain.generate(prompts, ["?"] * 3, n=2, temperature=0.0)
    b = engine.generate(prompts, ["?"] * 3, n=2, temperature=0.0)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    # Colocation: the payload leaves the device and comes back as tensors of their own, joined again
    # (the engine does this on CUDA, where it fuses; forced here).
    engine.fuses_projections = True
    engine.release_memory(("weights",))
    engine.resume_memory(("weights",))
    if dense:
        assert attn.k_proj.dense.untyped_storage().data_ptr() == attn.q_proj.dense.untyped_storage().data_ptr()
    assert getattr(attn.k_proj, first).untyped_storage().data_ptr() == getattr(attn.q_proj, first).untyped_storage().data_ptr()
    assert [s.response_ids for s in engine.generate(prompts, ["?"] * 3, n=2, temperature=0.0)] == \
        [s.response_ids for s in a]


def test_fp8_blocks_straddling_two_projections_stay_unjoined(tmp_path):
    from miles.config.schema import FP8Scheme, PrecisionCfg, Quant

    model = ModelCfg(name="q", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=32, max_position_embeddings=64)  # k / v: 64 rows
    ckpt = str(random_checkpoint(model, DEFAULT_ALPHABET, 0, tmp_path / "m"))
    precision = PrecisionCfg(name="fp8", rollout_quant=Quant.fp8, fp8_scheme=FP8Scheme.w8a16)
    engine = NativeEngine(ckpt, RolloutCfg(max_new_tokens=4), DType.fp32, seed=0, precision=precision)
    fused_projections.enable(engine.model)
    assert fused_projections.join_quantized(engine.model) == 2  # gate / up of each layer only
