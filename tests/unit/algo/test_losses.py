import math

import torch

from miles.algo.kl import kl_k1, kl_k2, kl_k3, kl_low_var
from miles.algo.losses import entropy_from_logits, nll_loss, ppo_clip_loss, token_logprobs


def test_ratio_one_means_no_clipping_and_zero_kl():
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3)
    loss, m = ppo_clip_loss(logp, logp.clone(), adv, mask, normalizer=3.0)
    assert m["ppo_kl"].item() == 0.0
    assert m["pg_clipfrac"].item() == 0.0
    torch.testing.assert_close(loss, -adv.mean())


def test_ppo_clip_hand_computed():
    # ratios 1.5 (A=+1: clipped at 1.2), 0.5 (A=-1: clipped at 0.8), 1.1 (A=+2: inside), masked token.
    ratio = torch.tensor([[1.5, 0.5, 1.1, 3.0]])
    old = torch.zeros(1, 4)
    logp = torch.log(ratio)
    adv = torch.tensor([[1.0, -1.0, 2.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, m = ppo_clip_loss(logp, old, adv, mask, normalizer=3.0, eps_clip=0.2, eps_clip_high=0.2)
    # per token max(-A r, -A clip(r)): max(-1.5,-1.2)=-1.2; max(0.5,0.8)=0.8; max(-2.2,-2.2)=-2.2
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8 - 2.2) / 3))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(2 / 3))
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(-(math.log(1.5) + math.log(0.5) + math.log(1.1)) / 3))


def test_clip_higher_uses_the_upper_bound():
    logp = torch.log(torch.tensor([[1.25]]))
    loss, m = ppo_clip_loss(logp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 1.0, 0.2, 0.28)
    torch.testing.assert_close(loss, torch.tensor(-1.25))  # 1.25 < 1.28: not clipped
    assert m["pg_clipfrac"].item() == 0.0


def test_normalizer_makes_micro_batches_add_up():
    torch.manual_seed(0)
    logp, old, adv = torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    total = mask.sum().item()
    full, _ = ppo_clip_loss(logp, old, adv, mask, total)
    halves = sum(ppo_clip_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], total)[0] for i in (0, 2))
    torch.testing.assert_close(full, halves)


def test_nll_and_token_logprobs():
    logits = torch.tensor([[[0.0, math.log(3.0)], [math.log(4.0), 0.0]]])  # probs [1/4, 3/4], [4/5, 1/5]
    targets = torch.tensor([[1, 1]])
    lp = token_logprobs(logits, targets)
    torch.testing.assert_close(lp, torch.log(torch.tensor([[0.75, 0.2]])))
    loss, _ = nll_loss(lp, torch.ones(1, 2), normalizer=2.0)
    torch.testing.assert_close(loss, -(math.log(0.75) + math.log(0.2)) / 2 * torch.ones(()))
    # temperature 2 halves the logits
    torch.testing.assert_close(token_logprobs(logits, targets, 2.0), token_logprobs(logits / 2, targets))


def test_entropy():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[1.5 * math.log(2)]]))


def test_kl_estimators_hand_computed():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.4]))
    torch.testing.assert_close(kl_k1(logp, ref), torch.tensor([math.log(2), math.log(0.5)]))
    # k3 = r - 1 - log r with r = ref / pi: r = 0.5 and 2
    expected = torch.tensor([0.5 - 1 - math.log(0.5), 2 - 1 - math.log(2)])
    torch.testing.assert_close(kl_k3(logp, ref), expected)
    assert kl_k3(logp, logp).abs().max().item() == 0.0


def test_k2_and_low_var_kl_hand_computed():
    logp = torch.log(torch.tensor([0.5, 0.2]))
    ref = torch.log(torch.tensor([0.25, 0.4]))
    # log-ratios log 2 and log(1/2): k2 = 0.5 * (log 2)^2 for both
    torch.testing.assert_close(kl_k2(logp, ref), torch.full((2,), 0.5 * math.log(2) ** 2))
    assert kl_k2(logp, logp).abs().max().item() == 0.0
    # low_var_kl is k3 while nothing is clamped ...
    torch.testing.assert_close(kl_low_var(logp, ref), kl_k3(logp, ref))
    assert kl_low_var(logp, logp).abs().max().item() == 0.0
    # ... and at most 10, with no gradient, when the log-ratio is extreme either way (k3: 29 and e^30 - 31)
    far = torch.tensor([0.0, -30.0], requires_grad=True)
    value = kl_low_var(far, torch.tensor([-30.0, 0.0]))
    torch.testing.assert_close(value, torch.tensor([10.0, 10.0]))
    value.sum().backward()
    assert far.grad.abs().max().item() == 0.0
