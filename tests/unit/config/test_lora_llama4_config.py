"""trainer.lora.target_modules naming experts on Llama 4 (its transposed stacks, miles/models/llama4.py)
validates and is counted; an entry naming experts that selects nothing is refused, never skipped."""

from miles.hardware.lora_footprint import lora_params
from miles.validate import validate

LLAMA4 = ["model=llama4_tiny", "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,experts]"]


def test_llama4_expert_adapters_validate_and_are_counted(compose):
    cfg = compose(LLAMA4)
    assert validate(cfg) == []
    # llama4_tiny: MoE layers 1 and 3, 4 experts, hidden 128, expert width 128; q_proj 128 -> 128 in 4 layers.
    rank, experts, hidden, width = 4, 4, 128, 128
    gate_up = experts * rank * (hidden + 2 * width)  # [E, H, 2I]: A [E, r, 2I], B [E, H, r]
    down = experts * rank * (width + hidden)
    q_proj = rank * (hidden + hidden)
    arch = cfg.model.arch(100)
    assert lora_params(arch, rank, ["q_proj", "experts"]) == 4 * q_proj + 2 * (gate_up + down)
    assert lora_params(arch, rank, ["experts.down_proj"]) == 2 * down


def test_an_expert_entry_that_selects_nothing_is_refused(compose):
    problems = validate(compose(["model=qwen3_tiny", "trainer.lora.rank=4",
                                 "trainer.lora.target_modules=[q_proj,experts]"]))
    assert problems == ["trainer.lora.target_modules entry 'experts' names MoE experts, and model=qwen3_tiny has no "
                        "stacked experts or projection it selects: drop it from trainer.lora.target_modules"]
    # An entry naming DeepSeek's shared experts' projections (nn.Linear modules) selects them: accepted.
    shared = compose(["model=deepseek_v3_tiny", "trainer.lora.rank=4",
                      "trainer.lora.target_modules=[shared_experts.gate_proj]"])
    assert [p for p in validate(shared) if "target_modules" in p] == []
