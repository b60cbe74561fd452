"""trainer.lora.target_modules naming MoE experts: what validate() refuses with them, and the planner's
adapter count (hand-computed for qwen3_moe_tiny: 3 layers, 8 experts, hidden 64, expert width 32)."""

from miles.config.schema import RunCfg
from miles.hardware.lora_footprint import lora_params
from miles.validate import validate

MOE = ["model=qwen3_moe_tiny", "trainer.lora.rank=4", "trainer.lora.target_modules=[q_proj,experts]"]


def _lora(problems):
    return [p for p in problems if "lora" in p]


def test_expert_adapters_validate_with_the_native_engine(compose):
    assert validate(compose(MOE)) == []


def test_refusals_name_what_to_change(compose):
    vllm = _lora(validate(compose([*MOE, "rollout=vllm"])))
    assert any("rollout=native" in p and "experts" in p for p in vllm)
    dropout = _lora(validate(compose([*MOE, "trainer.lora.dropout=0.1"])))
    assert any("trainer.lora.dropout=0" in p for p in dropout)
    dense = _lora(validate(compose(["model=qwen3_tiny", "trainer.lora.rank=4", "trainer.lora.target_modules=[experts]"])))
    assert any("matches no projection" in p and "experts" not in p.split("projections:")[1] for p in dense)


def test_planner_counts_each_experts_adapters(compose):
    cfg: RunCfg = compose(MOE)
    arch = cfg.model.arch(100)
    rank, layers, experts, hidden, width = 4, 3, 8, 64, 32
    q_proj = rank * (hidden + 4 * 16)  # [64 -> 4 heads x 16]
    per_layer_experts = experts * rank * (hidden + 2 * width) + experts * rank * (width + hidden)
    assert lora_params(arch, rank, ["q_proj", "experts"]) == layers * (q_proj + per_layer_experts)
    assert lora_params(arch, rank, ["q_proj"]) == layers * q_proj
