"""The planner's PPO critic: a whole value model trained in full, LoRA or not, and one per adapter
with several LoRA adapters (miles.trainer.critic.Critics)."""

from miles.hardware.footprint import param_groups
from miles.hardware.planner import TrainLayout, train_usage

TINY = ["model.vocab_size=100", "precision=bf16", "hardware=h100", "algo=ppo"]
TOTAL = 603_712  # qwen3_tiny's parameters with a 100-token vocabulary (test_planner.py)


def _critic(compose, overrides):
    cfg = compose(TINY + overrides)
    return train_usage(cfg, param_groups(cfg.model.arch(100), cfg.precision), TrainLayout(tp=1, pp=1, ep=1),
                       gpus=1)["critic"]


def test_a_critic_per_adapter(compose):
    full = TOTAL * (2 + 4 + 12)  # bf16 weights, fp32 gradients, fp32 master + AdamW moments (one GPU)
    assert _critic(compose, []) == full
    assert _critic(compose, ["trainer.lora.rank=8"]) == full  # the policy's LoRA does not shrink the critic
    assert _critic(compose, ["trainer.lora.rank=8", "trainer.lora.adapters=[a,b,c]"]) == 3 * full
