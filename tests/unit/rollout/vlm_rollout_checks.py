"""What the VLM rollout tests (images: test_vlm_rollout.py, videos: test_vlm_video_rollout.py) both check."""

import torch

from miles.config.schema import AlgoCfg, AlgoName, DType, PrecisionCfg, TrainerCfg
from miles.trainer.torch_trainer import TorchTrainer
from miles.types import build_train_batch

FP32 = PrecisionCfg(name="fp32", train_dtype=DType.fp32, rollout_dtype=DType.fp32)


def assert_trainer_recomputes_the_engine(directory, samples, pad_id: int) -> None:
    """A GRPO step on the engine's samples: the trainer's log-probs with the same vision inputs equal
    the engine's (fp32), and the first step's ppo_kl / clip fraction are exactly 0."""
    trainer = TorchTrainer(str(directory), AlgoCfg(name=AlgoName.grpo), TrainerCfg(global_batch_size=12,
                           micro_batch_size=12), FP32, temperature=1.0)
    for i, s in enumerate(samples):
        s.reward = float(i % 3 == 0)
    advantages = torch.tensor([s.reward for s in samples]) - 0.3
    metrics = trainer.train_rl(build_train_batch(samples, advantages, pad_id))
    assert metrics["mismatch/logprob_abs_diff"] < 1e-6, metrics
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0


def layout_logprobs(directory, batch, padded_rows: int, max_tokens: int) -> tuple[dict[str, torch.Tensor], TorchTrainer]:
    """The trainer's log-probs of `batch` in the padded, packed and prompt-sharing layouts (they must
    agree: no sample saw another's images or videos), and the prompt-sharing trainer."""
    layouts = {"padded": TrainerCfg(pack_sequences=False, micro_batch_size=padded_rows),
               "packed": TrainerCfg(share_prompts=False, max_tokens_per_micro_batch=max_tokens),
               "shared": TrainerCfg(share_prompts=True, max_tokens_per_micro_batch=max_tokens)}
    out = {}
    for name, cfg in layouts.items():
        trainer = TorchTrainer(str(directory), AlgoCfg(name=AlgoName.grpo), cfg, FP32, temperature=1.0)
        out[name] = trainer.logprobs(batch)
    return out, trainer
