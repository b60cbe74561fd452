import math

import pytest
import torch

from miles.algo.registry import ADVANTAGES, get


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
    with pytest.raises(ValueError, match="valid: grpo"):
        get(ADVANTAGES, "advantage estimator", "nope")
