"""Torch trainer: on-policy invariants, gradient accumulation, mismatch metric, SFT learning."""

import pytest
import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, TrainerCfg
from miles.orchestrate.loop import sft_batch
from miles.data.arithmetic import ArithmeticTask
from miles.trainer.torch_trainer import TorchTrainer
import numpy as np

FP32 = PrecisionCfg(name="fp32")


def grpo(**kw):
    return AlgoCfg(name=AlgoName.grpo, **kw)


def test_first_step_is_exactly_on_policy(ckpt, rollout_batch):
    trainer = TorchTrainer(ckpt, grpo(), TrainerCfg(global_batch_size=16, micro_batch_size=4), FP32)
    m = trainer.train_rl(rollout_batch)
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    # the engine and the trainer run the same modules: log-probs agree to float rounding
    assert m["mismatch/logprob_abs_diff"] < 1e-5
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert key in m and m[key] == m[key]  # present and not NaN


def test_second_step_moves_off_policy(ckpt, rollout_batch):
    trainer = TorchTrainer(ckpt, grpo(num_steps_per_rollout=2), TrainerCfg(lr=1e-2, global_batch_size=8,
                                                                           micro_batch_size=4), FP32)
    m = trainer.train_rl(rollout_batch)
    # mean over the two steps: the first contributes 0, the second sees a moved policy
    assert m["train/ppo_kl"] != 0.0


def test_bf16_training_keeps_the_invariant(ckpt, rollout_batch):
    prec = PrecisionCfg(name="bf16", train_dtype=DType.bf16, rollout_dtype=DType.bf16)
    trainer = TorchTrainer(ckpt, grpo(), TrainerCfg(global_batch_size=16, micro_batch_size=8), prec)
    m = trainer.train_rl(rollout_batch)
    assert m["train/ppo_kl"] == 0.0 and m["train/pg_clipfrac"] == 0.0
    weights, _ = trainer.get_weights()
    assert all(w.dtype == torch.bfloat16 for w in weights.values())


@pytest.mark.parametrize("layouts", [
    [dict(pack_sequences=False, micro_batch_size=m) for m in (16, 4, 2)],
    [dict(pack_sequences=True, max_tokens_per_micro_batch=t) for t in (4096, 24, 12)],  # 1, 4, 8 micro-batches
])
def test_gradient_accumulation_equals_one_big_batch(ckpt, rollout_batch, layouts):
    states = []
    for layout in layouts:
        trainer = TorchTrainer(ckpt, grpo(), TrainerCfg(lr=1e-2, global_batch_size=16, **layout), FP32)
        trainer.train_rl(rollout_batch)
        states.append(trainer.model.state_dict())
    # Adam's first update is about lr * g / (|g| + eps): for a gradient element near eps (1e-8), the
    # summation-order rounding of accumulation moves it by up to ~1e-3 * lr. A wrong normalizer
    # would move every element by a large fraction of lr (1e-2).
    for other in states[1:]:
        for k in states[0]:
            torch.testing.assert_close(other[k], states[0][k], atol=1e-5, rtol=1e-5)


def test_mismatch_metric_measures_rollout_logprob_error(ckpt, rollout_batch):
    shifted = rollout_batch.slice(0, 16)
    shifted.rollout_logprobs = rollout_batch.rollout_logprobs + 0.25 * rollout_batch.loss_mask
    trainer = TorchTrainer(ckpt, grpo(), TrainerCfg(global_batch_size=16, micro_batch_size=16), FP32)
    assert abs(trainer.train_rl(shifted)["mismatch/logprob_abs_diff"] - 0.25) < 1e-4


def test_kl_to_reference_starts_at_zero(ckpt, rollout_batch):
    trainer = TorchTrainer(ckpt, grpo(kl_coef=0.1, kl_estimator="k3"),
                           TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=8), FP32)
    assert trainer.train_rl(rollout_batch)["train/kl_ref"] == 0.0
    assert trainer.train_rl(rollout_batch)["train/kl_ref"] > 0.0  # the policy moved away from the reference


def test_sft_learns_a_fixed_batch(ckpt):
    from miles.data.tokenizer import TokenizerInfo

    examples = ArithmeticTask(seed=0).sample_train(16, np.random.default_rng(0))
    batch = sft_batch(examples, TokenizerInfo.load(ckpt))
    trainer = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.sft, policy_loss="nll"),
                           TrainerCfg(lr=3e-3, global_batch_size=16, micro_batch_size=8), FP32)
    losses = [trainer.train_sft(batch)["train/loss"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]


def test_kl_in_reward_is_not_charged_again_in_the_loss(ckpt, rollout_batch):
    trainer = TorchTrainer(ckpt, grpo(kl_coef=0.1, kl_in_reward=True),
                           TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=8), FP32)
    assert torch.equal(trainer.kl_to_ref(rollout_batch), torch.zeros_like(rollout_batch.loss_mask))
    trainer.train_rl(rollout_batch)
    kl = trainer.kl_to_ref(rollout_batch)  # the policy moved: positive (k3) on response tokens only
    assert (kl[rollout_batch.loss_mask > 0] > 0).all() and (kl[rollout_batch.loss_mask == 0] == 0).all()
    assert "train/kl_ref" not in trainer.train_rl(rollout_batch)


def test_teacher_equal_to_the_student_adds_nothing(ckpt, rollout_batch):
    cfg = TrainerCfg(lr=1e-2, global_batch_size=16, micro_batch_size=8)
    plain = TorchTrainer(ckpt, grpo(), cfg, FP32)
    distilled = TorchTrainer(ckpt, grpo(opd_kl_coef=1.0), cfg, FP32, teacher_dir=ckpt)
    m_plain, m_distilled = plain.train_rl(rollout_batch), distilled.train_rl(rollout_batch)
    assert m_distilled.pop("train/reverse_kl") == 0.0
    assert m_distilled == m_plain


def test_distillation_pulls_the_student_to_the_teacher(ckpt, rollout_batch, tmp_path):
    # A teacher = the student after a few SFT steps; pure OPD (no reward advantage) lowers the reverse KL.
    from miles.data.tokenizer import TokenizerInfo
    from miles.orchestrate.checkpoints import copy_tokenizer

    sft = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.sft, policy_loss="nll"),
                       TrainerCfg(lr=3e-3, global_batch_size=16, micro_batch_size=16), FP32)
    examples = ArithmeticTask(seed=0).sample_train(16, np.random.default_rng(0))
    for _ in range(10):
        sft.train_sft(sft_batch(examples, TokenizerInfo.load(ckpt)))
    sft.save(str(tmp_path))
    copy_tokenizer(ckpt, tmp_path)
    batch = rollout_batch.slice(0, 16)
    batch.advantages = torch.zeros_like(batch.advantages)
    cfg = TrainerCfg(lr=3e-3, global_batch_size=16, micro_batch_size=8)
    student = TorchTrainer(ckpt, AlgoCfg(name=AlgoName.opd, opd_kl_coef=1.0), cfg, FP32, teacher_dir=str(tmp_path))
    kls = [student.train_rl(batch)["train/reverse_kl"] for _ in range(10)]
    assert kls[0] > 0 and kls[-1] < 0.5 * kls[0]
