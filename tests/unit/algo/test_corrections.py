import math

import pytest
import torch

from miles.algo.corrections import mis_mask, tis_weights


def _equal_logps():
    torch.manual_seed(0)
    logp = torch.randn(3, 5) - 2
    return logp, logp.clone(), torch.tensor([[1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0], [0.0] + [1.0] * 4])


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_tis_with_equal_logprobs_is_the_identity(level):
    old, rollout, mask = _equal_logps()
    w, m = tis_weights(old, rollout, mask, level=level)
    assert torch.equal(w, torch.ones_like(w))
    assert m["tis_mean"].item() == 1.0 and m["tis_clipfrac"].item() == 0.0


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_with_equal_logprobs_masks_nothing(level):
    old, rollout, mask = _equal_logps()
    new_mask, m = mis_mask(old, rollout, mask, low=0.5, high=2.0, level=level)
    assert torch.equal(new_mask, mask) and m["mis_maskfrac"].item() == 0.0


def _token_case():
    # ratios pi_old / pi_rollout 3, 0.5, 1.5; the 4th token is padding with a non-finite difference
    rollout = torch.tensor([[-1.0, -1.0, -1.0, -math.inf]])
    old = rollout + torch.log(torch.tensor([[3.0, 0.5, 1.5, 1.0]]))
    old[0, 3] = -1.0
    return old, rollout, torch.tensor([[1.0, 1.0, 1.0, 0.0]])


def test_tis_token_level_hand_computed():
    old, rollout, mask = _token_case()
    w, m = tis_weights(old, rollout, mask, clip_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 1.5, 1.0]]))  # padding: neutral 1, not inf / NaN
    torch.testing.assert_close(m["tis_mean"], torch.tensor((2.0 + 0.5 + 1.5) / 3))
    torch.testing.assert_close(m["tis_clipfrac"], torch.tensor(1 / 3))
    w, m = tis_weights(old, rollout, mask, clip_high=2.0, clip_low=0.6)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.6, 1.5, 1.0]]))
    torch.testing.assert_close(m["tis_clipfrac"], torch.tensor(2 / 3))


def _sequence_case():
    # sequence ratios: 1.5 * 1.2 = 1.8 (3rd token masked), 3 (2nd and 3rd masked); masked log-ratios are large
    log_ratio = torch.tensor([[math.log(1.5), math.log(1.2), 5.0], [math.log(3.0), 7.0, 7.0]])
    rollout = torch.full((2, 3), -2.0)
    return rollout + log_ratio, rollout, torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_tis_sequence_level_hand_computed():
    old, rollout, mask = _sequence_case()
    w, m = tis_weights(old, rollout, mask, level="sequence", clip_high=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.8, 1.8, 1.8], [2.0, 2.0, 2.0]]))
    torch.testing.assert_close(m["tis_mean"], torch.tensor((1.8 * 2 + 2.0) / 3))
    torch.testing.assert_close(m["tis_clipfrac"], torch.tensor(1 / 3))


def test_mis_hand_computed():
    old, rollout, mask = _token_case()
    new_mask, m = mis_mask(old, rollout, mask, low=0.6, high=2.0)  # drops ratios 3 and 0.5
    assert torch.equal(new_mask, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(m["mis_maskfrac"], torch.tensor(2 / 3))
    old, rollout, mask = _sequence_case()
    new_mask, m = mis_mask(old, rollout, mask, low=0.5, high=2.0, level="sequence")  # drops sequence 2
    assert torch.equal(new_mask, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(m["mis_maskfrac"], torch.tensor(1 / 3))


def test_unknown_level():
    with pytest.raises(ValueError, match="valid: token, sequence"):
        tis_weights(*_token_case(), level="tokens")
