"""The RL loop's rollout collection: dynamic sampling keeps the batch size and prefers informative
groups; the overlong penalty shapes rewards. Real engine on a tiny random model; the reward is a
deterministic stand-in so group outcomes are controlled."""

import numpy as np
import pytest

from miles.config.schema import AlgoCfg, AlgoName, ModelCfg, RolloutCfg, RunCfg, TaskCfg
from miles.data.source import PromptSource
from miles.data.tokenizer import TokenizerInfo
from miles.orchestrate.checkpoints import random_checkpoint
from miles.orchestrate.handles import LocalHandle
from miles.orchestrate.loop import LoopContext, collect_rollout
from miles.rollout.native import NativeEngine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = ModelCfg(name="t", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, max_position_embeddings=64)
    return str(random_checkpoint(model, "0123456789+-*=() ", 0, tmp_path_factory.mktemp("ck")))


def make(ckpt, reward_fn, **algo):
    cfg = RunCfg(model=ModelCfg(name="t"), algo=AlgoCfg(name=AlgoName.dapo, **algo),
                 rollout=RolloutCfg(batch_size=6, n_samples_per_prompt=4, max_new_tokens=6),
                 task=TaskCfg(name="arithmetic"))
    ctx = LoopContext(engine=LocalHandle(NativeEngine(ckpt, cfg.rollout, seed=0)), trainer=None,
                      source=PromptSource(cfg.task, 0), tokenizer=TokenizerInfo.load(ckpt), reward_fn=reward_fn,
                      log=lambda m, s: None)
    return ctx, cfg


def test_dynamic_sampling_keeps_informative_groups(ckpt):
    # Only prompts with an even first operand can vary: half the groups are uninformative.
    rng = np.random.default_rng(0)
    reward = lambda response, label: float(rng.random() < 0.5) if int(label) % 2 == 0 else 0.0  # noqa: E731
    ctx, cfg = make(ckpt, reward, dynamic_sampling=True, max_draws=8)
    samples, metrics = collect_rollout(ctx, cfg)
    assert len(samples) == 24 and sorted({s.group for s in samples}) == list(range(6))
    # one draw cannot fill the batch (about half the groups are constant); a few more do
    assert 1 < metrics["rollout/num_draws"] <= 8
    assert metrics["rollout/informative_group_frac"] == 1.0
    for g in range(6):
        assert len({s.reward for s in samples if s.group == g}) > 1


def test_dynamic_sampling_tops_up_when_draws_run_out(ckpt):
    ctx, cfg = make(ckpt, lambda response, label: 1.0, dynamic_sampling=True, max_draws=2)
    samples, metrics = collect_rollout(ctx, cfg)
    assert len(samples) == 24  # the batch invariant holds even when nothing is informative
    assert metrics == {"rollout/num_draws": 2.0, "rollout/informative_group_frac": 0.0, "rollout/reward_errors": 0.0}


def test_without_dynamic_sampling_one_draw(ckpt):
    ctx, cfg = make(ckpt, lambda response, label: 1.0)
    samples, metrics = collect_rollout(ctx, cfg)
    assert len(samples) == 24 and metrics == {"rollout/reward_errors": 0.0}


def test_overlong_penalty_shapes_rewards(ckpt):
    ctx, cfg = make(ckpt, lambda response, label: 1.0, overlong_buffer=2)
    samples, _ = collect_rollout(ctx, cfg)
    for s in samples:
        n = len(s.response_ids)  # budget 6, buffer 2: penalty starts after 4 tokens
        expected = 1.0 - max(0, n - 4) / 2
        assert s.reward == pytest.approx(expected)


def test_a_failing_reward_scores_zero_and_is_counted(ckpt):
    def reward(response, label, prompt):
        if prompt.startswith("1"):
            raise ValueError("bad sample")
        return 1.0

    ctx, cfg = make(ckpt, reward)
    samples, metrics = collect_rollout(ctx, cfg)
    failed = [s for s in samples if s.prompt.startswith("1")]
    assert metrics["rollout/reward_errors"] == len(failed)
    assert all(s.reward == (0.0 if s.prompt.startswith("1") else 1.0) for s in samples)
