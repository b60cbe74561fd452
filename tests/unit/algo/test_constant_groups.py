"""Groups whose rewards are all equal carry no learning signal: every estimator gives them exactly 0.

Non-dyadic rewards (0.1, 0.3, 0.7, 0.9: weighted sums, partial credit, remote scorers) are the hard
case: the fp32 mean of eight 0.7s is not 0.7, so "r - mean" is ~6e-8, and GRPO's std division
turned it into +0.056 for the whole group (issue 25).
"""

import math

import pytest
import torch

from miles.algo.advantages import keep_groups_with_variance, masked_whiten
from miles.algo.registry import ADVANTAGES, get

REWARDS = (0.1, 0.3, 0.7, 0.9)
SIZES = range(2, 17)
DTYPES = (torch.float32, torch.bfloat16)
# reinforce_pp has no group baseline: only a constant *batch* carries no signal for it.
GROUP_BASELINE = sorted(set(ADVANTAGES) - {"reinforce_pp"})


def _call(name, rewards, groups, **kw):
    """The loop's call (miles/orchestrate/returns.py), with each estimator's default eps."""
    return get(ADVANTAGES, "advantage estimator", name)(rewards, groups, **kw)


def test_issue_repro_grpo_eight_and_sixteen_sevenths():
    for n in (8, 16):
        adv = _call("grpo", torch.full((n,), 0.7), torch.zeros(n, dtype=torch.long), norm_by_std=True)
        assert torch.equal(adv, torch.zeros(n)), adv  # was +0.05603 (n=8), +0.10614 (n=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_a_constant_batch_gets_exactly_zero(name, dtype):
    for r in REWARDS:
        for n in SIZES:
            for norm_by_std in (True, False):
                adv = _call(name, torch.full((n,), r, dtype=dtype), torch.zeros(n, dtype=torch.long),
                            norm_by_std=norm_by_std)
                assert torch.equal(adv, torch.zeros(n)), (r, n, norm_by_std, adv)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", GROUP_BASELINE)
def test_constant_groups_in_a_mixed_batch_get_exactly_zero(name, dtype):
    # Two constant groups of different values (so the batch itself is not constant, as it was above)
    # next to an informative group; interleaved, so nothing depends on groups being contiguous.
    mixed = torch.tensor([0.0, 1.0, 0.5])
    for r in REWARDS:
        for n in SIZES:
            rewards = torch.cat([torch.full((n,), r), torch.full((n,), 0.1), mixed]).to(dtype)
            groups = torch.cat([torch.zeros(n), torch.full((n,), 5.0), torch.full((3,), 2.0)]).long()
            perm = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(n))
            rewards, groups = rewards[perm], groups[perm]
            constant = groups != 2
            for norm_by_std in (True, False):
                adv = _call(name, rewards, groups, norm_by_std=norm_by_std)
                assert torch.equal(adv[constant], torch.zeros(2 * n)), (r, n, norm_by_std, adv)
                if name != "none":
                    assert (adv[~constant] != 0).any()  # and the informative group still has a signal


# Mixed group 0.1, 0.3, 0.7, 0.9 next to a constant group of n 0.7s: mean 0.5, deviations
# -0.4, -0.2, 0.2, 0.4, unbiased group variance (0.16 + 0.04 + 0.04 + 0.16) / 3 = 0.4 / 3.
DEV = torch.tensor([-0.4, -0.2, 0.2, 0.4])


@pytest.mark.parametrize("n", (2, 7, 16))
@pytest.mark.parametrize("name,expected", [
    ("grpo", lambda n: DEV / math.sqrt(0.4 / 3)),
    ("dr_grpo", lambda n: DEV),
    ("rloo", lambda n: DEV * 4 / 3),  # r_i - mean of the other three = 4/3 (r_i - mean)
    # batch std of the centred rewards: n + 4 values, mean 0, squares summing to 0.4, unbiased
    ("reinforce_pp_baseline", lambda n: DEV / math.sqrt(0.4 / (n + 3))),
])
def test_mixed_group_values_by_hand(name, expected, n):
    rewards = torch.cat([torch.tensor(REWARDS), torch.full((n,), 0.7)])
    groups = torch.cat([torch.zeros(4), torch.ones(n)]).long()
    adv = _call(name, rewards, groups, norm_by_std=True, eps=0.0)
    torch.testing.assert_close(adv[:4], expected(n))
    assert torch.equal(adv[4:], torch.zeros(n))


def test_dynamic_sampling_drops_exactly_the_zero_advantage_groups():
    # keep_groups_with_variance and the estimators share one exact test for "constant".
    rewards = torch.tensor([0.7] * 8 + [0.1, 0.3] + [0.3] * 3 + [0.9])
    groups = torch.tensor([0] * 8 + [1, 1] + [2] * 3 + [3])
    keep = keep_groups_with_variance(rewards, groups)
    assert keep.tolist() == [False] * 8 + [True, True] + [False] * 4
    for name in GROUP_BASELINE:
        assert torch.equal(_call(name, rewards, groups, norm_by_std=True)[~keep], torch.zeros(12))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_whiten_of_equal_values_is_exactly_zero(dtype):
    # GAE advantages go through masked_whiten; its float mean can miss equal values too, and
    # rsqrt(var + eps) with var ~ 1e-16 magnified that to ~6e-4 before.
    for r in REWARDS:
        for n in SIZES:
            x = torch.full((2, n), r, dtype=dtype)
            x[1, 0] = 100.0  # a masked-out token: not part of the statistics
            mask = torch.ones(2, n)
            mask[1, 0] = 0.0
            assert torch.equal(masked_whiten(x, mask), torch.zeros(2, n, dtype=dtype)), (r, n)
    # no loss token at all: 0, not NaN
    assert torch.equal(masked_whiten(torch.ones(2, 3), torch.zeros(2, 3)), torch.zeros(2, 3))
