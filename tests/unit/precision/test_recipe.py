"""A recipe applied to both sides: the trainer's quantized forward and the engine holding the sync
payload compute the same logits (fp32: bitwise), the engine really holds the payload format, and
the sync checksum compares what the engine holds with what the trainer sent."""

import copy

import pytest
import torch

from miles.config.schema import FP8Scheme, PrecisionCfg, Quant
from miles.models import ArchConfig, CausalLM
from miles.precision.recipe import QuantLinear, Recipe

ARCH = ArchConfig(vocab_size=50, hidden_size=256, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=64, rope_theta=10000.0)  # K = 256 / 384: two and three 128-wide blocks


def recipe(train: str, rollout: str, group: int = 128, scheme: str = "w8a8") -> Recipe:
    cfg = PrecisionCfg(name="t", train_quant=Quant(train), rollout_quant=Quant(rollout), int4_group_size=group,
                       fp8_scheme=FP8Scheme(scheme))
    return Recipe.from_cfg(cfg, ARCH.num_layers)


def engine_of(model: CausalLM, r: Recipe) -> CausalLM:
    engine = copy.deepcopy(model).requires_grad_(False)
    r.prepare_engine(engine)
    payload = r.sync_payload(model.state_dict())
    r.load_engine(engine, payload, torch.float32)
    assert r.held_checksum(engine) == r.expected_checksum(payload, engine, torch.float32)
    return engine


@pytest.mark.parametrize("quant,group,scheme", [("fp8", 128, "w8a8"), ("fp8", 128, "w8a16"), ("int4", 128, "w8a8"),
                                                ("int4", 32, "w8a8")])
def test_trainer_forward_equals_engine_forward_bitwise(quant, group, scheme):
    model = CausalLM(ARCH, seed=0)
    r = recipe(quant, quant, group, scheme)
    engine = engine_of(model, r)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        train_logits, engine_logits, plain = r.forward(model, ids), engine(ids), model(ids)
    assert torch.equal(train_logits, engine_logits)
    assert (train_logits - plain).abs().max() > 1e-4  # the quantization is real


def test_engine_holds_the_payload_format():
    model = CausalLM(ARCH, seed=0)
    engine = engine_of(model, recipe("int4", "int4"))
    q_proj = engine.layers[0].self_attn.q_proj
    assert isinstance(q_proj, QuantLinear) and q_proj.weight_packed.dtype == torch.uint8
    assert q_proj.weight_packed.shape == (256, 128)  # two 4-bit codes per byte
    assert not isinstance(engine.lm_head, QuantLinear)  # kept in high precision
    engine = engine_of(model, recipe("fp8", "fp8"))
    assert engine.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn


def test_mismatched_recipe_differs_and_checksum_catches_tampering():
    model = CausalLM(ARCH, seed=0)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    mixed = recipe("none", "fp8")  # bf16_train_fp8_rollout's shape: the trainer does not see the quantizer
    engine = engine_of(model, mixed)
    with torch.no_grad():
        assert (mixed.forward(model, ids) - engine(ids)).abs().max() > 1e-4
    payload = mixed.sync_payload(model.state_dict())
    payload["layers.0.mlp.up_proj.weight_scale_inv"] = payload["layers.0.mlp.up_proj.weight_scale_inv"] * 2
    mixed.load_engine(engine, payload, torch.float32)
    assert mixed.held_checksum(engine) != mixed.expected_checksum(mixed.sync_payload(model.state_dict()),
                                                                  engine, torch.float32)


@pytest.mark.parametrize("scheme", ["w8a8", "w8a16"])
def test_straight_through_gradients_reach_the_master_weights(scheme):
    model = CausalLM(ARCH, seed=0)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(2))
    recipe("fp8", "fp8", scheme=scheme).forward(model, ids).logsumexp(-1).sum().backward()
    assert model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_w8a16_keeps_activations_and_quantizes_weights_once_per_step():
    """fp8_scheme=w8a16: the engine multiplies unquantized activations (its logits differ from w8a8's,
    whose 1x128 activation rounding is gone), the trainer's weight gradient is the straight-through
    one of F.linear on the dequantized weight, and the dequantized copies are made once per version
    of the master weights (a second forward quantizes nothing; an optimizer step re-quantizes)."""
    from miles.precision.fp8 import dequantize_fp8_weight, quantize_fp8_weight

    model = CausalLM(ARCH, seed=0)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(3))
    r16, r8 = recipe("fp8", "fp8", scheme="w8a16"), recipe("fp8", "fp8")
    with torch.no_grad():
        assert not torch.equal(engine_of(model, r16)(ids), engine_of(model, r8)(ids))
    # The gradient equals that of a copy whose q_proj weight is the dequantized weight, made trainable.
    ref = copy.deepcopy(model)
    q = ref.layers[0].self_attn.q_proj
    q.weight.data = dequantize_fp8_weight(*quantize_fp8_weight(q.weight.data))
    r16.forward(model, ids).logsumexp(-1).sum().backward()
    recipe("fp8", "fp8", scheme="w8a16").forward(ref, ids).logsumexp(-1).sum().backward()
    assert torch.equal(model.layers[0].self_attn.q_proj.weight.grad, q.weight.grad)
    cache = r16.fp8_cache
    made = len(cache)
    up = model.layers[0].mlp.up_proj.weight
    entry = cache.dequantized(up, torch.float32)  # the forward's (fp32 model, no autocast)
    with torch.no_grad():
        r16.forward(model, ids)
    assert len(cache) == made and cache.dequantized(up, torch.float32) is entry
    with torch.no_grad():
        up.add_(1e-2)  # an optimizer step: a new version
        r16.forward(model, ids)
    assert cache.dequantized(up, torch.float32) is not entry


def test_engine_and_trainer_components_sync_quantized_weights(tmp_path):
    """The real components: NativeEngine holds the int4 payload, TorchTrainer's get_weights sends it
    with the checksum of what the engine must hold; a tampered payload is refused."""
    from miles.config.schema import AlgoCfg, AlgoName, DType, RolloutCfg, TrainerCfg
    from miles.models import save_pretrained
    from miles.transport.checksum import WeightSyncError
    from miles.rollout.native import NativeEngine
    from miles.trainer.torch_trainer import TorchTrainer
    from miles.data.tokenizer import build_char_tokenizer, save_tokenizer

    tok = build_char_tokenizer("0123456789+=")
    save_pretrained(CausalLM(ArchConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, intermediate_size=256,
                                        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, eos_token_id=2,
                                        pad_token_id=0, bos_token_id=1), seed=0), tmp_path)
    save_tokenizer(tok, tmp_path)
    precision = PrecisionCfg(name="int4_qat", train_dtype=DType.fp32, rollout_dtype=DType.fp32,
                             train_quant=Quant.int4, rollout_quant=Quant.int4)
    engine = NativeEngine(str(tmp_path), RolloutCfg(), DType.fp32, precision=precision)
    assert isinstance(engine.model.layers[0].mlp.up_proj, QuantLinear)
    trainer = TorchTrainer(str(tmp_path), AlgoCfg(name=AlgoName.grpo), TrainerCfg(), precision)
    payload, digest = trainer.get_weights()
    assert engine.update_weights(payload, digest) == digest
    payload["layers.1.mlp.down_proj.weight_scale"] = payload["layers.1.mlp.down_proj.weight_scale"] * 1.5
    with pytest.raises(WeightSyncError):
        engine.update_weights(payload, digest)


@pytest.mark.parametrize("quant,scheme", [("none", "w8a8"), ("fp8", "w8a8"), ("fp8", "w8a16"), ("int4", "w8a8")])
def test_forward_on_rollout_weights_is_the_engines_bf16_forward_bitwise(quant, scheme):
    """precision.forward_weights=rollout: the training forward multiplies the master weights cast to
    the engine's dtype (bf16 here), so its residual stream is the engine's too: the logits equal the
    engine's full forward bit for bit (with the fp32 masters under autocast and precision.fp32_residual
    they do not), and the gradients still reach the fp32 masters."""
    from miles.config.schema import DType

    model = CausalLM(ARCH, seed=0)
    cfg = PrecisionCfg(name="t", train_quant=Quant(quant), rollout_quant=Quant(quant), train_dtype=DType.bf16,
                       rollout_dtype=DType.bf16, forward_weights="rollout", fp8_scheme=FP8Scheme(scheme))
    r = Recipe.from_cfg(cfg, ARCH.num_layers)
    engine = copy.deepcopy(model).requires_grad_(False).to(torch.bfloat16)
    if quant != "none":
        r.prepare_engine(engine)
        r.load_engine(engine, r.sync_payload(model.state_dict()), torch.bfloat16)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(r.forward(model, ids), engine(ids))
        model.fp32_residual = True
        with torch.autocast("cpu", dtype=torch.bfloat16):
            master = Recipe.from_cfg(PrecisionCfg(name="t", train_quant=Quant(quant), rollout_quant=Quant(quant),
                                                  fp8_scheme=FP8Scheme(scheme)), ARCH.num_layers).forward(model, ids)
        model.fp32_residual = False
        assert not torch.equal(master, engine(ids))
    r.forward(model, ids).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_masters_under_autocast_compute_the_engines_bf16_forward_bitwise():
    """The bf16 recipe's training forward (fp32 masters under autocast, the default bf16 residual
    stream: embeddings, norms and residual adds in bf16) gives the logits of the engine's bf16 weights
    bit for bit on the CPU; precision.fp32_residual=true keeps the stream in fp32 and moves them."""
    model = CausalLM(ARCH, seed=0)
    engine = copy.deepcopy(model).requires_grad_(False).to(torch.bfloat16)
    ids = torch.randint(0, 50, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_stream = model(ids)
            model.fp32_residual = True
            fp32_stream = model(ids)
        assert torch.equal(bf16_stream, engine(ids))
        assert float((fp32_stream.float() - engine(ids).float()).abs().max()) > 1e-3
