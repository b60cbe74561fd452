"""The memory plan of LoRA / QLoRA on the FSDP2 trainer (trainer=fsdp): each rank holds its shard of
the frozen base (under fp8 / int4_qat its quantized codes and scales, miles/trainer/fsdp_qlora.py)
and of the KL reference, and the whole adapters with their gradients and AdamW state (replicated).
tests/unit/trainer/test_fsdp_qlora.py checks that 2 real ranks together hold the 1-process
QLoRA trainer's bytes, which tests/unit/hardware/test_qlora_plan.py equates with the plan."""

import pytest
from test_qlora_plan import ADAPTERS, FP8_BYTES, INT4_BYTES, KEPT, TINY, TOTAL

from miles.hardware.footprint import param_groups
from miles.hardware.planner import TrainLayout, train_usage

FSDP = ["trainer=fsdp", "ray.enabled=true"]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("recipe, base_bytes", [("fp8", FP8_BYTES), ("int4_qat", INT4_BYTES),
                                                ("bf16", 2 * TOTAL)])
def test_each_rank_holds_its_shard_of_the_base_and_the_whole_adapters(compose, recipe, base_bytes, ranks):
    cfg = compose(TINY + FSDP + [f"precision={recipe}", f"trainer.num_ranks={ranks}", "algo.kl_coef=0.1"])
    arch = cfg.model.arch(100)
    if recipe != "bf16":  # QLoRA: the codes and scales, plus the kept fp32 tensors
        base_bytes += KEPT * 4
    usage = train_usage(cfg, param_groups(arch, cfg.precision), TrainLayout(tp=1, pp=1, ep=1), gpus=ranks)
    assert usage["weights"] == base_bytes / ranks + ADAPTERS * 4
    assert usage["reference"] == base_bytes / ranks
    assert (usage["gradients"], usage["optimizer"]) == (ADAPTERS * 4, ADAPTERS * 8)
