"""On-policy distillation: reverse-KL advantages by hand, and the policy-gradient identity they rely on."""

import torch

from miles.algo.distill import reverse_kl_advantages


def test_reverse_kl_advantages_hand_computed():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # log-ratios 0.5, -1.0 (the masked token is ignored): advantages -0.5, +1.0; k1 estimate -0.25
    adv, m = reverse_kl_advantages(student, teacher, mask)
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 1.0, 0.0]]))
    torch.testing.assert_close(m["reverse_kl"], torch.tensor(-0.25))
    adv2, _ = reverse_kl_advantages(student, teacher, mask, coef=2.0)
    torch.testing.assert_close(adv2, 2 * adv)


def test_same_model_gives_no_signal():
    logp = torch.tensor([[-0.3, -2.0]])
    adv, m = reverse_kl_advantages(logp, logp, torch.ones(1, 2))
    assert torch.equal(adv, torch.zeros(1, 2)) and m["reverse_kl"] == 0.0


def test_policy_gradient_with_these_advantages_descends_the_reverse_kl():
    # One categorical step, expectation taken exactly over actions a ~ pi:
    #   sum_a pi(a) * A(a) * grad log pi(a) == -grad KL(pi || q)   with A = -(log pi - log q), constant.
    torch.manual_seed(0)
    theta = torch.randn(6, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(6), -1)
    logp = torch.log_softmax(theta, -1)
    adv, _ = reverse_kl_advantages(logp.detach()[None], teacher[None], torch.ones(1, 6))
    surrogate = (logp.exp().detach() * adv[0] * logp).sum()
    (pg,) = torch.autograd.grad(surrogate, theta, retain_graph=True)
    kl = (logp.exp() * (logp - teacher)).sum()
    (kl_grad,) = torch.autograd.grad(kl, theta)
    torch.testing.assert_close(pg, -kl_grad)
