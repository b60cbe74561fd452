"""The memory plan of a QLoRA run (trainer.lora with precision=fp8 / int4_qat): the frozen base at
its quantized bytes on the trainer side, by hand for qwen3_tiny and against what a real trainer holds."""

import pytest

from miles.hardware.footprint import param_groups
from miles.hardware.lora_footprint import quantized_base
from miles.hardware.planner import TrainLayout, make_plan, train_usage

# qwen3_tiny with a 100-token vocabulary (tests/unit/hardware/test_planner.py): 603,712 parameters, of
# which the embedding (12,800, tied) and the norms (3 x 320 + 128) stay fp32. Per layer the recipes
# quantize q [128,128], k and v [64,128], o [128,128], gate and up [384,128], down [128,384]:
# 196,608 weights, 589,824 in 3 layers.
TINY = ["model.vocab_size=100", "hardware=h100", "trainer.pack_sequences=false", "trainer.lora.rank=8"]
TOTAL, QUANTIZED = 603_712, 589_824
KEPT = TOTAL - QUANTIZED  # 13,888
# fp8: a byte a weight + an fp32 scale per 128x128 block: q, k, v, o one block each, gate / up /
# down three each = 13 blocks a layer.
FP8_BYTES = QUANTIZED + 3 * 13 * 4
# int4 (groups of 128 along the input): N x K / 2 bytes + 4 bytes per (row, group): q and o 128 rows,
# k and v 64, gate and up 384 (one group each), down 128 rows of three groups.
INT4_BYTES = QUANTIZED // 2 + 3 * 4 * (128 + 128 + 64 + 64 + 384 + 384 + 128 * 3)
ADAPTERS = 3 * 8 * 2432  # rank 8 x (in + out) over a layer's 7 projections, 3 layers


@pytest.mark.parametrize("recipe, base_bytes", [("fp8", FP8_BYTES), ("int4_qat", INT4_BYTES)])
def test_the_quantized_base_by_hand(compose, recipe, base_bytes):
    cfg = compose(TINY + [f"precision={recipe}"])
    arch = cfg.model.arch(100)
    assert quantized_base(arch, cfg.precision) == (QUANTIZED, base_bytes)
    usage = train_usage(cfg, param_groups(arch, cfg.precision), TrainLayout(tp=2, pp=1, ep=1), gpus=8)
    assert usage["weights"] == (KEPT * 4 + base_bytes) / 2 + ADAPTERS / 2 * 4  # TP=2 shards both
    assert (usage["gradients"], usage["optimizer"]) == (ADAPTERS / 2 * 4, ADAPTERS / 2 * 8)
    # LoRA over the same model in bf16: the whole base at 2 bytes.
    bf16 = compose(TINY + ["precision=bf16"])
    lora = train_usage(bf16, param_groups(arch, bf16.precision), TrainLayout(tp=2, pp=1, ep=1), gpus=8)
    assert lora["weights"] == TOTAL + ADAPTERS / 2 * 4
    # The KL reference is held as the policy's base.
    kl = compose(TINY + [f"precision={recipe}", "algo.kl_coef=0.1"])
    assert train_usage(kl, param_groups(arch, kl.precision), TrainLayout(2, 1, 1), 8)["reference"] == \
        (KEPT * 4 + base_bytes) / 2


@pytest.mark.parametrize("recipe", ["fp8", "int4_qat"])
def test_the_plan_is_what_the_trainer_holds(compose, recipe, tmp_path):
    from miles.orchestrate.checkpoints import random_checkpoint
    from miles.trainer.torch_trainer import TorchTrainer

    cfg = compose(["model=qwen3_tiny", f"precision={recipe}", "trainer.lora.rank=8"])
    ckpt = random_checkpoint(cfg.model, "0123456789+=", 0, tmp_path)
    trainer = TorchTrainer(str(ckpt), cfg.algo, cfg.trainer, cfg.precision)
    arch = trainer.model.config
    held = sum(t.numel() * t.element_size() for t in [*trainer.model.parameters(), *trainer.model.buffers()])
    q_params, q_bytes = quantized_base(arch, cfg.precision)
    groups = param_groups(arch, cfg.precision)
    weights = groups.embed + groups.dense + groups.routed
    assert held == (weights - q_params) * 4 + q_bytes
    assert held / (4 * weights) < (0.26 if recipe == "fp8" else 0.14)  # of the fp32 masters' bytes
    assert held == train_usage(cfg, groups, TrainLayout(1, 1, 1), gpus=1)["weights"] - trainer.lora.num_bytes()


def test_qlora_fits_where_lora_over_a_bf16_base_does_not(compose):
    """Qwen3-32B on H100 x 8 at TP=1 PP=1: a bf16 base (66 GB) with the activations of 2048-token
    micro-batches needs more than the 72 GB usable per GPU; the FP8 base (38 GB) fits."""
    pinned = ["model=qwen3_32b", "hardware=h100", "trainer.tp=1", "trainer.pp=1", "trainer.offload_optimizer=false",
              "trainer.max_tokens_per_micro_batch=2048", "trainer.lora.rank=16"]
    bf16 = make_plan(compose(pinned + ["precision=bf16"]), suggest=False)
    fp8 = make_plan(compose(pinned + ["precision=fp8"]), suggest=False)
    assert not bf16.fits and fp8.fits, fp8.problems
    assert fp8.train["weights"] < 0.6 * bf16.train["weights"]


def test_the_plan_table_says_the_base_is_held_quantized(compose):
    import io

    from rich.console import Console

    from miles.hardware.planner import make_plan
    from miles.hardware.report import plan_table

    cfg = compose(["precision=fp8", "trainer.lora.rank=16"])
    out = io.StringIO()
    Console(file=out, width=250).print(plan_table(cfg, make_plan(cfg)))
    assert "frozen base in fp8 (QLoRA), adapters fp32" in out.getvalue()
