"""PPO critic math: the clipped value loss and explained variance, against hand-computed values."""

import torch

from miles.algo.value import explained_variance, value_loss

# Three tokens, clip 0.2:
#   t0: V 0.5, old 0.2, R 1 -> unclipped (0.5 - 1)^2 = 0.25; V_clip = 0.2 + 0.2 = 0.4 -> 0.36 (clipped taken)
#   t1: V 1.0, old 0.2, R 0 -> unclipped 1.0; V_clip = 0.4 -> 0.16 (unclipped taken)
#   t2: V -0.2, old 0.0, R 0 -> unclipped 0.04; V_clip = -0.2 -> 0.04 (equal: not counted as clipped)
V = torch.tensor([[0.5, 1.0, -0.2]])
OLD = torch.tensor([[0.2, 0.2, 0.0]])
R = torch.tensor([[1.0, 0.0, 0.0]])


def test_value_loss_with_clipping_hand_computed():
    values = V.clone().requires_grad_(True)
    loss, m = value_loss(values, OLD, R, torch.ones(1, 3), normalizer=3.0, value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.36 + 1.0 + 0.04) / 3))
    torch.testing.assert_close(m["vf_clipfrac"], torch.tensor(1 / 3))
    loss.backward()
    # t0's clipped term is flat in V: no gradient; t1: 0.5 * 2 * (1.0 - 0) / 3; t2: both terms move with V
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1 / 3, 2 * 0.5 * (-0.2) / 3]]))


def test_value_loss_respects_the_mask_and_normalizer():
    loss, m = value_loss(V, OLD, R, torch.tensor([[1.0, 1.0, 0.0]]), normalizer=2.0, value_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.36 + 1.0) / 2))
    torch.testing.assert_close(m["vf_clipfrac"], torch.tensor(0.5))


def test_value_loss_without_clip_is_half_the_squared_error():
    loss, m = value_loss(V, OLD, R, torch.ones(1, 3), normalizer=3.0, value_clip=None)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (0.25 + 1.0 + 0.04) / 3))
    assert m["vf_clipfrac"] == 0.0


def test_first_update_is_never_clipped():
    # V == old_V (the critic has not moved since it scored the batch): clipping cannot act
    loss, m = value_loss(OLD, OLD, R, torch.ones(1, 3), normalizer=3.0, value_clip=0.2)
    plain, _ = value_loss(OLD, OLD, R, torch.ones(1, 3), normalizer=3.0, value_clip=None)
    assert m["vf_clipfrac"] == 0.0 and torch.equal(loss, plain)


def test_explained_variance():
    returns = torch.tensor([[1.0, 0.0, 1.0, 0.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == 1.0  # a perfect critic
    assert explained_variance(torch.full_like(returns, 0.5), returns, mask) == 0.0  # the mean return
    # V = 0: Var[R - V] = Var[R] -> 0 as well; V = 1 - R: Var[2R - 1] = 4 Var[R] -> 1 - 4 = -3
    torch.testing.assert_close(explained_variance(1 - returns, returns, mask), torch.tensor(-3.0))
    assert explained_variance(returns, torch.ones_like(returns), mask) == 0.0  # nothing to explain
