"""mismatch/ratio_{mean,std,min,max}: pi_old / pi_rollout statistics, hand-computed."""

import math
from types import SimpleNamespace

import pytest
import torch

from miles.algo.corrections import ratio_stats
from miles.config.schema import AlgoCfg, AlgoName
from miles.trainer.rl_update import RLUpdate
from miles.types import TrainBatch


def _case():
    # loss-token ratios 2, 0.5, 1 (row 0) and 1.5 (row 1); masked positions hold large or non-finite
    # differences that must not count: ratio 100 at [1, 0], a -inf rollout log-prob at [1, 2].
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -math.inf]])
    old = rollout + torch.log(torch.tensor([[2.0, 0.5, 1.0], [100.0, 1.5, 1.0]]))
    old[1, 2] = -1.0
    return old, rollout, torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])


def test_ratio_stats_hand_computed():
    old, rollout, mask = _case()
    m = ratio_stats(old, rollout, mask)
    torch.testing.assert_close(m["ratio_mean"], torch.tensor((2.0 + 0.5 + 1.0 + 1.5) / 4))  # 1.25
    # deviations from 1.25: 0.75, -0.75, -0.25, 0.25 -> variance (2 * 0.5625 + 2 * 0.0625) / 4 = 0.3125
    torch.testing.assert_close(m["ratio_std"], torch.tensor(math.sqrt(0.3125)))
    torch.testing.assert_close(m["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(m["ratio_max"], torch.tensor(2.0))


@pytest.mark.parametrize("empty", [False, True])
def test_ratio_stats_neutral_cases(empty):
    old, rollout, mask = _case()
    if empty:  # no loss token: 1.0, not NaN or +-inf
        m = ratio_stats(old, rollout, torch.zeros_like(mask))
    else:  # equal log-probs: every ratio is exactly 1
        m = ratio_stats(rollout.clamp(min=-5.0), rollout.clamp(min=-5.0), mask)
    assert {k: v.item() for k, v in m.items()} == {"ratio_mean": 1.0, "ratio_std": 0.0, "ratio_min": 1.0,
                                                   "ratio_max": 1.0}


STATS = {"mismatch/ratio_mean": 1.25, "mismatch/ratio_std": math.sqrt(0.3125), "mismatch/ratio_min": 0.5,
         "mismatch/ratio_max": 2.0}


def _correct(tis: str = "none", mis: str = "none", mis_low: float = 0.6, mis_high: float = 1.8):
    old, rollout, mask = _case()
    batch = TrainBatch(tokens=torch.zeros(2, 4, dtype=torch.long), loss_mask=mask,
                       advantages=torch.ones_like(mask), rollout_logprobs=rollout)
    algo = AlgoCfg(name=AlgoName.grpo, tis=tis, tis_clip=3.0, mis=mis, mis_low=mis_low, mis_high=mis_high)
    trainer = SimpleNamespace(algo=algo, device=torch.device("cpu"))
    return RLUpdate(trainer)._correct(batch, old)


def test_correct_logs_ratio_stats_with_or_without_a_correction():
    # (train_rl logs the same from its training forward when no separate old pass runs:
    # tests/unit/trainer/test_trainer_paths.py compares the metrics of the two paths.)
    assert _correct()[1] == pytest.approx(STATS)
    batch, metrics = _correct(mis="token", mis_low=0.0, mis_high=math.inf)  # a band that masks nothing
    assert metrics == pytest.approx({**STATS, "mismatch/mis_maskfrac": 0.0})
    assert torch.equal(batch.advantages, torch.ones(2, 3)) and torch.equal(batch.loss_mask, _case()[2])


def test_correct_ratio_stats_are_taken_before_mis():
    batch, metrics = _correct(tis="token", mis="token")  # MIS [0.6, 1.8] drops the ratios 2 and 0.5
    assert torch.equal(batch.loss_mask, torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
    assert metrics == pytest.approx({**STATS, "mismatch/tis_mean": 1.25, "mismatch/tis_clipfrac": 0.0,
                                     "mismatch/mis_maskfrac": 0.5})
