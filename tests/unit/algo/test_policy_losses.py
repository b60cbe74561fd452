import math

import pytest
import torch

from miles.algo.losses import AGG_MODES, aggregate, loss_normalizer, ppo_clip_loss
from miles.algo.policy_losses import cispo_loss, gspo_loss
from miles.algo.registry import POLICY_LOSSES, get

RL_LOSSES = sorted(set(POLICY_LOSSES) - {"nll"})


# ----------------------------------------------------------------------------- aggregation
def test_aggregate_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the empty row counts nowhere
    # masked sum 10 over 4 tokens and 2 non-empty sequences; per-sequence means 2 and 4
    expected = {"token_mean": (4, 10 / 4), "seq_mean_token_sum": (2, 10 / 2),
                "seq_mean_token_mean": (2, (2 + 4) / 2), "constant": (3 * 2, 10 / 6)}
    for mode, (norm, value) in expected.items():
        assert loss_normalizer([mask], mode, max_len=3) == norm
        torch.testing.assert_close(aggregate(per_token, mask, mode, norm), torch.tensor(value))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_normalizer_add_up(mode):
    torch.manual_seed(0)
    x = torch.randn(6, 5)
    mask = (torch.rand(6, 5) > 0.4).float()
    mask[3] = 0.0  # a sequence without loss tokens
    mask[2:4, 3:] = 0.0  # the middle micro-batch is padded only to its own length, 3
    mbs = [(x[:2], mask[:2]), (x[2:4, :3], mask[2:4, :3]), (x[4:], mask[4:])]
    norm = loss_normalizer([m for _, m in mbs], mode, max_len=5)
    assert norm == loss_normalizer([mask], mode, max_len=5)
    total = sum(aggregate(xb, mb, mode, norm) for xb, mb in mbs)
    torch.testing.assert_close(total, aggregate(x, mask, mode, norm))


def test_aggregate_rejects_unknown_modes():
    with pytest.raises(ValueError, match="valid: token_mean"):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum", 1.0)
    with pytest.raises(ValueError, match="max_len"):
        loss_normalizer([torch.ones(1, 1)], "constant")


# ----------------------------------------------------------------------------- shared identities
@pytest.mark.parametrize("name", RL_LOSSES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_every_rl_loss_takes_the_trainers_call_and_adds_up(name, mode):
    torch.manual_seed(1)
    logp, old, adv = torch.randn(4, 5) * 0.3 - 1, torch.randn(4, 5) * 0.3 - 1, torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    norm = loss_normalizer([mask], mode, max_len=5)
    fn = get(POLICY_LOSSES, "policy loss", name)
    full, _ = fn(logp, old, adv, mask, norm, eps_clip=0.2, eps_clip_high=0.2, agg_mode=mode)
    halves = sum(fn(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], norm, eps_clip=0.2,
                    eps_clip_high=0.2, agg_mode=mode)[0] for i in (0, 2))
    torch.testing.assert_close(full, halves)


CLIPPED = {
    "ppo_clip": lambda *a: ppo_clip_loss(*a, eps_clip=0.2, eps_clip_high=0.28),
    "ppo_dual_clip": lambda *a: ppo_clip_loss(*a, eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0),
    "gspo": lambda *a: gspo_loss(*a, eps_clip=3e-4, eps_clip_high=4e-4),
    "cispo": lambda *a: cispo_loss(*a, eps_clip=0.2, eps_clip_high=0.28),
}


@pytest.mark.parametrize("name", CLIPPED)
def test_ratio_one_means_no_clipping(name):
    torch.manual_seed(2)
    logp = torch.randn(3, 4) - 1
    adv = torch.randn(3, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    loss, m = CLIPPED[name](logp, logp.clone(), adv, mask, 9.0)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    assert m.get("pg_clipfrac_lower", torch.zeros(())).item() == 0.0
    # unclipped, the weight is 1: the surrogate is -A (PPO, GSPO), CISPO's is -A * logp
    per_token = -adv * logp if name == "cispo" else -adv
    torch.testing.assert_close(loss, (per_token * mask).sum() / 9.0)


def test_all_rl_losses_are_checked_for_ratio_one():
    assert set(RL_LOSSES) <= set(CLIPPED)


# ----------------------------------------------------------------------------- dual clip
def _dual_clip_batch():
    # A=-1 r=5 (capped at c=3), A=+1 r=5 (clipped at 1.2), A=-1 r=0.5 (clipped at 0.8), A=-2 r=1.1 (inside)
    logp = torch.log(torch.tensor([[5.0, 5.0, 0.5, 1.1]])).requires_grad_()
    return logp, torch.zeros(1, 4), torch.tensor([[-1.0, 1.0, -1.0, -2.0]]), torch.ones(1, 4)


def test_dual_clip_hand_computed():
    logp, old, adv, mask = _dual_clip_batch()
    loss, m = ppo_clip_loss(logp, old, adv, mask, 4.0, dual_clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor((3.0 - 1.2 + 0.8 + 2.2) / 4))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(2 / 4))
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(1 / 4))
    loss.backward()
    assert logp.grad[0, 0] == 0.0  # the capped token is a constant -A * c
    plain, m_plain = ppo_clip_loss(logp, old, adv, mask, 4.0)
    torch.testing.assert_close(plain, torch.tensor((5.0 - 1.2 + 0.8 + 2.2) / 4))
    assert "pg_clipfrac_lower" not in m_plain  # off by default: ppo_clip's metrics are unchanged


def test_dual_clip_only_acts_on_negative_advantages():
    torch.manual_seed(3)
    logp, old = torch.randn(4, 6) * 2, torch.randn(4, 6) * 2  # ratios far outside [1/c, c]
    adv = torch.randn(4, 6)
    mask = torch.ones(4, 6)
    pos = adv.abs()
    assert torch.equal(ppo_clip_loss(logp, old, pos, mask, 24.0, dual_clip_c=3.0)[0],
                       ppo_clip_loss(logp, old, pos, mask, 24.0)[0])
    # token by token: the two differ exactly where A < 0 and the PPO term exceeds -A * c, i.e. r > c
    changed = torch.stack([
        ppo_clip_loss(logp, old, adv, m, 1.0, dual_clip_c=3.0)[0] != ppo_clip_loss(logp, old, adv, m, 1.0)[0]
        for m in torch.eye(24).view(24, 4, 6)
    ]).view(4, 6)
    assert torch.equal(changed, (adv < 0) & (torch.exp(logp - old) > 3.0))
    assert changed.any()


def test_dual_clip_c_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip_loss(*_dual_clip_batch(), 4.0, dual_clip_c=1.0)


# ----------------------------------------------------------------------------- GSPO
def test_gspo_equals_ppo_for_one_token_responses():
    torch.manual_seed(4)
    old = torch.randn(4, 3) - 1
    logp = old + torch.randn(4, 3)  # the masked tokens' ratios are random and must not matter
    adv = torch.randn(4, 3)
    mask = torch.zeros(4, 3)
    rows, cols = torch.arange(4), torch.tensor([0, 2, 1, 2])  # one loss token per row, anywhere
    mask[rows, cols] = 1.0
    # loss tokens: clipped high (A > 0), clipped low (A < 0), inside, ratio < 1 with A > 0
    logp[rows, cols] = old[rows, cols] + torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7]))
    adv[rows, cols] = torch.tensor([1.0, -2.0, 0.5, 3.0])
    logp.requires_grad_()
    g_loss, g_m = gspo_loss(logp, old, adv, mask, 4.0, eps_clip=0.2, eps_clip_high=0.28)
    (g_grad,) = torch.autograd.grad(g_loss, logp)
    p_loss, p_m = ppo_clip_loss(logp, old, adv, mask, 4.0, eps_clip=0.2, eps_clip_high=0.28)
    (p_grad,) = torch.autograd.grad(p_loss, logp)
    torch.testing.assert_close(g_loss, p_loss)
    torch.testing.assert_close(g_grad, p_grad)
    assert g_m.keys() == p_m.keys()
    torch.testing.assert_close(p_m["pg_clipfrac"], torch.tensor(2 / 4))  # both clipping paths taken
    for k in p_m:
        torch.testing.assert_close(g_m[k], p_m[k])


def test_gspo_hand_computed():
    # seq 0: token log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1.2, A = +1: clipped, -1.2 per token,
    #        no gradient.
    # seq 1: 0.3, -0.3 -> s = 1 (PPO would clip its first token, r = e^0.3 = 1.35): -A = -2 per token.
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.3], [0.3, -0.3]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    loss, m = gspo_loss(logp, old, adv, torch.ones(2, 2), 4.0, eps_clip=0.2, eps_clip_high=0.2)
    torch.testing.assert_close(loss, torch.tensor((-1.2 * 2 - 2.0 * 2) / 4))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.5))
    # seq 1: loss = 2 tokens * (-2 s) / 4 = -s, ds/dlogp_t = s / 2 = 0.5 -> gradient -0.5 on each token
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0], [-0.5, -0.5]]))


def _sequence_level_gspo(logp, old, adv, mask, normalizer, eps_clip, eps_clip_high, agg_mode):
    """The paper's sequence-level GSPO (what gspo_loss computed before GSPO-token): the loss
    differentiates s_i itself, so each token's gradient carries the sequence's advantages."""
    seq = ((logp - old) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    s = torch.exp(seq)
    per_token = torch.maximum(-adv * s, -adv * torch.clamp(s, 1.0 - eps_clip, 1.0 + eps_clip_high))
    return aggregate(per_token, mask, agg_mode, normalizer)


def test_gspo_token_repro_per_token_advantages():
    # issue 25: old = logp, A = [1, -1], seq-mean-token-mean over one sequence. s = 1, loss
    # (-A_0 s - A_1 s) / 2 = 0. GSPO-token: d loss / d logp_t = -A_t s / 2 = [-0.5, 0.5]; the
    # sequence-level form gives -mean(A) s / 2 = 0 to both tokens, no signal at all.
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    loss, m = gspo_loss(logp, logp.detach().clone(), adv, mask, 1.0, agg_mode="seq_mean_token_mean")
    (grad,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0.0 and m["pg_clipfrac"].item() == 0.0
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.5]]))
    seq_loss = _sequence_level_gspo(logp, logp.detach(), adv, mask, 1.0, 3e-4, 4e-4, "seq_mean_token_mean")
    assert torch.equal(torch.autograd.grad(seq_loss, logp)[0], torch.zeros(1, 2))


def test_gspo_token_hand_computed_with_clipping():
    # eps 0.2 / 0.2, token mean over 4 tokens.
    # seq 0: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1.2. A = [+1, -1]:
    #   token 0 (A > 0): max(-s, -1.2) = -1.2, clipped, no gradient;
    #   token 1 (A < 0): max(s, 1.2) = s, unclipped, gradient -A_1 s / 4 = s / 4 on token 1 alone.
    #   (Sequence-level: d s / d logp_t = s / 2 on both tokens -> [s / 8, s / 8].)
    # seq 1: 0.3, -0.3 -> s = 1, A = [2, 0.5], unclipped: gradient -A_t / 4 = [-0.5, -0.125].
    #   (Sequence-level: -(2 + 0.5) / 2 / 4 = -0.3125 on both.)
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.3], [0.3, -0.3]], requires_grad=True)
    adv, mask = torch.tensor([[1.0, -1.0], [2.0, 0.5]]), torch.ones(2, 2)
    s = math.exp(0.2)
    loss, m = gspo_loss(logp, old, adv, mask, 4.0, eps_clip=0.2, eps_clip_high=0.2)
    torch.testing.assert_close(loss, torch.tensor((-1.2 + s - 2.0 - 0.5) / 4))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(1 / 4))
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, s / 4], [-0.5, -0.125]]))
    seq_loss = _sequence_level_gspo(logp, old, adv, mask, 4.0, 0.2, 0.2, "token_mean")
    torch.testing.assert_close(loss, seq_loss)  # same value: s_i,t equals s_i
    torch.testing.assert_close(torch.autograd.grad(seq_loss, logp)[0],
                               torch.tensor([[s / 8, s / 8], [-0.3125, -0.3125]]))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_token_equals_sequence_level_gspo_for_per_sequence_advantages(mode):
    # Per-sequence advantages are what every sequence-level estimator gives: there GSPO-token must
    # be the paper's GSPO, value and gradient, clipped sequences included.
    torch.manual_seed(6)
    old = torch.randn(8, 6) * 0.5 - 1
    # sequence log-ratios up to ~1e-3, against clip ranges of 3e-4 / 4e-4: some sequences clip, some not
    logp = (old + torch.randn(8, 6) * 1e-3).requires_grad_()
    adv = torch.randn(8, 1).expand(8, 6).contiguous()
    mask = (torch.rand(8, 6) > 0.25).float()
    mask[:, 0] = 1.0
    norm = loss_normalizer([mask], mode, max_len=6)
    loss, m = gspo_loss(logp, old, adv, mask, norm, agg_mode=mode)
    ref = _sequence_level_gspo(logp, old, adv, mask, norm, 3e-4, 4e-4, mode)
    frac = float(aggregate(torch.ones(8, 6), mask, mode, norm))  # what pg_clipfrac reads if all clip
    assert 0 < m["pg_clipfrac"].item() < frac  # clipping is active on part of the batch
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss, logp)[0], torch.autograd.grad(ref, logp)[0])


@pytest.mark.parametrize("overrides", [["algo.advantage=gae"], ["algo.opd_kl_coef=0.5"], ["algo.tis=token"]],
                         ids=lambda o: o[0])
def test_gspo_with_per_token_advantages_validates(compose, overrides):
    # The three ways per-token advantages reach algo=gspo are allowed: gspo_loss is GSPO-token there.
    from miles.validate import validate

    assert validate(compose(["algo=gspo", *overrides])) == []


# ----------------------------------------------------------------------------- CISPO
def test_cispo_hand_computed_value_and_gradient():
    # ratios 2 (A=+1: weight clipped to 1.28), 1 (A=-1: weight 1), 0.5 (A=+2: weight clipped to 0.8)
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.2]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.25, 0.4]]))
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, m = cispo_loss(logp, old, adv, torch.ones(1, 3), 3.0, eps_clip=0.2, eps_clip_high=0.28)
    w = torch.tensor([[1.28, 1.0, 0.8]])
    torch.testing.assert_close(loss, (-w * adv * logp).sum().detach() / 3)
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(2 / 3))
    loss.backward()
    # gradient -w * A / N on every token, clipped ones included; had the weight not been detached,
    # the unclipped token (r = 1) would get -A * (1 + logp) / N instead of -A / N
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28 / 3, 1.0 / 3, -1.6 / 3]]))
    # PPO gives the first token (A > 0, r = 2 > 1.28) no gradient at all
    ppo_logp = logp.detach().requires_grad_()
    ppo_clip_loss(ppo_logp, old, adv, torch.ones(1, 3), 3.0, 0.2, 0.28)[0].backward()
    assert ppo_logp.grad[0, 0] == 0.0


def test_cispo_gradient_equals_ppo_at_ratio_one():
    torch.manual_seed(5)
    logp = (torch.randn(3, 4) - 1).requires_grad_()
    adv, mask = torch.randn(3, 4), (torch.rand(3, 4) > 0.3).float()
    (c_grad,) = torch.autograd.grad(cispo_loss(logp, logp.detach(), adv, mask, 7.0)[0], logp)
    (p_grad,) = torch.autograd.grad(ppo_clip_loss(logp, logp.detach(), adv, mask, 7.0)[0], logp)
    torch.testing.assert_close(c_grad, p_grad)
    assert math.isclose(float(c_grad.abs().sum()), float((adv * mask).abs().sum() / 7.0), rel_tol=1e-5)
