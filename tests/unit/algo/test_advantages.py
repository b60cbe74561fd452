import math

import pytest
import torch

from miles.algo.advantages import (
    clip_rewards,
    gae_advantages,
    grpo_advantages,
    keep_groups_with_variance,
    masked_whiten,
    overlong_penalty,
    terminal_rewards,
)
from miles.algo.registry import ADVANTAGES, TOKEN_ADVANTAGES, get


def test_grpo_hand_computed():
    # Group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 1: 0, 0 -> all advantages 0.
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = get(ADVANTAGES, "advantage", "grpo")(rewards, groups, norm_by_std=True, eps=0.0)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)


def test_grpo_without_std_is_the_group_mean_baseline():
    rewards = torch.tensor([3.0, 1.0, 2.0, 5.0, 7.0, 9.0])
    groups = torch.tensor([1, 1, 1, 2, 2, 2])  # group ids need not start at 0
    adv = get(ADVANTAGES, "advantage", "grpo")(rewards, groups, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, -2.0, 0.0, 2.0]))


def test_grpo_interleaved_groups_and_zero_mean():
    rewards = torch.tensor([1.0, 2.0, 3.0, 6.0])
    groups = torch.tensor([0, 1, 0, 1])
    adv = get(ADVANTAGES, "advantage", "grpo")(rewards, groups, norm_by_std=True, eps=0.0)
    # each group {x, y} has mean (x+y)/2 and unbiased std |x-y|/sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-1, -1, 1, 1], dtype=torch.float32) / math.sqrt(2))


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="valid: dr_grpo, grpo, none, reinforce_pp, reinforce_pp_baseline, rloo"):
        get(ADVANTAGES, "advantage estimator", "nope")


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_every_estimator_takes_the_loops_call(name):
    # miles/orchestrate/loop.py calls advantage_fn(rewards, groups, norm_by_std=...) for any name.
    rewards, groups = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
    for norm_by_std in (True, False):
        adv = get(ADVANTAGES, "advantage", name)(rewards, groups, norm_by_std=norm_by_std)
        assert adv.shape == (4,) and adv.dtype == torch.float32 and torch.isfinite(adv).all()


def test_gae_is_only_a_token_level_estimator():
    assert TOKEN_ADVANTAGES["gae"] is gae_advantages and "gae" not in ADVANTAGES


def test_dr_grpo_is_grpo_without_std_whatever_the_flag():
    rewards = torch.tensor([3.0, 1.0, 2.0, 5.0, 7.0, 9.0, 4.0])
    groups = torch.tensor([1, 1, 1, 2, 2, 2, 3])
    expected = grpo_advantages(rewards, groups, norm_by_std=False)
    for norm_by_std in (True, False):
        adv = get(ADVANTAGES, "a", "dr_grpo")(rewards, groups, norm_by_std=norm_by_std)
        assert torch.equal(adv, expected)


def test_rloo_hand_computed():
    # Group 0 (interleaved with group 1): 1, 0, 0, 1 -> 1 - mean(0, 0, 1) = 2/3, 0 - mean(0, 1, 1) = -2/3.
    # Group 1: 3, 5 -> 3 - 5 = -2, 5 - 3 = 2. Group 2 is a singleton: no baseline, advantage 0.
    rewards = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0, 1.0, 7.0])
    groups = torch.tensor([0, 1, 0, 0, 1, 0, 2])
    adv = get(ADVANTAGES, "a", "rloo")(rewards, groups)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2.0, -2 / 3, -2 / 3, 2.0, 2 / 3, 0.0]))


def test_reinforce_pp_whitens_the_batch_and_ignores_groups():
    # mean 2, centred -2, -1, 0, 3, unbiased variance (4 + 1 + 0 + 9) / 3 = 14 / 3
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0])
    fn = get(ADVANTAGES, "a", "reinforce_pp")
    adv = fn(rewards, torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([-2.0, -1.0, 0.0, 3.0]) / math.sqrt(14 / 3))
    assert torch.equal(fn(rewards, torch.tensor([0, 1, 2, 3]), eps=0.0), adv)
    # constant batch and single sample: no signal, exactly 0 (no 0 / 0)
    assert torch.equal(fn(torch.full((3,), 0.7), torch.zeros(3), eps=0.0), torch.zeros(3))
    assert torch.equal(fn(torch.tensor([4.0]), torch.zeros(1)), torch.zeros(1))


def test_reinforce_pp_baseline_hand_computed():
    # group means 0.5 and 4 -> centred 0.5, -0.5, -1, 1 (batch mean 0); unbiased variance 2.5 / 3
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0])
    adv = get(ADVANTAGES, "a", "reinforce_pp_baseline")(rewards, torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -1.0, 1.0]) / math.sqrt(2.5 / 3))


def _gae_3_tokens(gamma, lam):
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    return gae_advantages(rewards, values, torch.ones(1, 3), gamma, lam)


def test_gae_hand_computed_gamma_1_lambda_1():
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t and every return is 1.
    adv, ret = _gae_3_tokens(1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_hand_computed_gamma_09_lambda_095():
    # delta_2 = 1 - 0.7 = 0.3; delta_1 = 0.9 * 0.7 - 0.6 = 0.03; delta_0 = 0.9 * 0.6 - 0.5 = 0.04
    # gamma * lam = 0.855: A_2 = 0.3; A_1 = 0.03 + 0.855 * 0.3 = 0.2865;
    # A_0 = 0.04 + 0.855 * 0.2865 = 0.04 + 0.2449575 = 0.2849575
    adv, ret = _gae_3_tokens(0.9, 0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.2849575, 0.2865, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.2849575 + 0.5, 0.2865 + 0.6, 0.3 + 0.7]]))


def test_gae_skips_masked_tokens():
    # The 3-token case with a masked (tool output) token inside and a padding token after; their
    # garbage rewards and values must not leak into the valid tokens.
    rewards = torch.tensor([[0.0, 50.0, 0.0, 1.0, 50.0]])
    values = torch.tensor([[0.5, 100.0, 0.6, 0.7, 100.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0, 0.0]])
    adv, ret = gae_advantages(rewards, values, mask, 0.9, 0.95)
    ref_adv, ref_ret = _gae_3_tokens(0.9, 0.95)
    torch.testing.assert_close(adv[:, [0, 2, 3]], ref_adv)
    torch.testing.assert_close(ret[:, [0, 2, 3]], ref_ret)
    assert adv[0, 1] == adv[0, 4] == ret[0, 1] == ret[0, 4] == 0.0


def test_terminal_rewards_land_on_the_last_response_token():
    # row 0: response tokens at 1..3 (then padding); row 1: a masked token inside; row 2: no tokens
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    out = terminal_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    expected = torch.zeros(3, 5)
    expected[0, 3], expected[1, 4] = 2.0, -1.0
    assert torch.equal(out, expected)


def test_gae_with_terminal_reward_and_gamma_lambda_1_is_reward_minus_value():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.2, 0.5, 0.9, 7.0]])
    adv, ret = gae_advantages(terminal_rewards(torch.tensor([1.0]), mask), values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.5, 0.1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))


def test_masked_whiten_uses_the_unbiased_variance_as_verl():
    # 1, 2, 3: mean 2, unbiased variance (1 + 0 + 1) / 2 = 1 -> -1, 0, 1 (the population variance,
    # 2/3, would give -1.2247, 0, 1.2247); verl's masked_whiten gives -1, 0, 1
    torch.testing.assert_close(masked_whiten(torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3), eps=0.0),
                               torch.tensor([[-1.0, 0.0, 1.0]]))


def test_masked_whiten_hand_computed():
    # unmasked 1, 2, 3, 6: mean 3, unbiased variance (4 + 1 + 0 + 9) / 3 = 14 / 3; masked entries -> 0
    # and do not enter the statistics
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 6.0, -100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    expected = torch.tensor([[-2.0, -1.0, 0.0], [0.0, 3.0, 0.0]]) / math.sqrt(14 / 3)
    torch.testing.assert_close(masked_whiten(x, mask, eps=0.0), expected)
    # the default eps = 1e-8 sits inside the square root (verl's rsqrt(var + 1e-8)): no visible change
    torch.testing.assert_close(masked_whiten(x, mask), expected)
    # one loss token: no spread to divide by, exactly 0 (verl raises here)
    assert torch.equal(masked_whiten(x, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])), torch.zeros(2, 3))


def test_none_gives_no_reward_signal():
    adv = get(ADVANTAGES, "a", "none")(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([0, 0, 1]), norm_by_std=True)
    assert torch.equal(adv, torch.zeros(3))


def test_clip_rewards():
    clipped = clip_rewards(torch.tensor([-3.0, 0.5, 4.0]), -1.0, 1.0)
    torch.testing.assert_close(clipped, torch.tensor([-1.0, 0.5, 1.0]))


def test_overlong_penalty_hand_computed():
    # max_len 10, cache 4: free up to 6, then -1/4 per token, -1 from 10 on
    lengths = torch.tensor([3, 6, 7, 8, 10, 11, 20])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=10, cache_len=4), expected)
    # no cache: a hard cutoff
    hard = overlong_penalty(torch.tensor([5, 10, 11]), max_len=10, cache_len=0)
    torch.testing.assert_close(hard, torch.tensor([0.0, 0.0, -1.0]))


def test_keep_groups_with_variance():
    # all-correct, mixed, all-wrong, singleton; equal floats that a float mean would miss (0.1 * 3)
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.3, 0.1, 0.1, 0.1])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4, 4])
    keep = keep_groups_with_variance(rewards, groups)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, False, False, False, False, False, False]
