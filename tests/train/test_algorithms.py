"""GRPO advantages and the DPPO gate and loss, against hand-computed values."""

import math

import pytest
import torch

from colonnade.train.advantages import group_advantages
from colonnade.train.loss import GateConfig, dppo_loss, dppo_mask


def test_group_advantages_subtract_the_mean_and_skip_flat_groups():
    out = group_advantages([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert out.values[0] == [0.5, -0.5, -0.5, 0.5]
    assert out.values[1] == [] and out.values[2] == []
    assert out.values[3] == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    assert out.skipped == 2


def test_group_advantages_scaled_by_std():
    out = group_advantages([[1.0, 0.0, 0.0, 1.0]], scale_by_std=True)
    assert out.values[0] == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    with pytest.raises(ValueError):
        group_advantages([[]])


def _lp(*probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


def test_gate_is_one_sided_by_the_sign_of_the_advantage():
    cfg = GateConfig(delta_low=0.15, delta_high=0.15)
    p = torch.tensor([0.9, 0.9, 0.1, 0.1, 0.5, 0.5])
    m = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.4, 0.6])
    a = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0])
    # p-m = +.4 (A>0: masked), +.4 (A<0: kept), -.4 (A>0: kept), -.4 (A<0: masked),
    # +.1 and -.1 are inside δ either way.
    assert dppo_mask(p, m, a, cfg).tolist() == [False, True, True, False, True, True]
    # Exactly at δ stays in (strict inequality), thresholds are separate.
    cfg2 = GateConfig(delta_low=0.5, delta_high=0.05)
    assert dppo_mask(
        torch.tensor([0.6, 0.1]), torch.tensor([0.5, 0.5]), torch.tensor([1.0, -1.0]), cfg2
    ).tolist() == [False, True]


def test_loss_matches_hand_computation():
    # Tokens: (p, m, A, model?)
    # t0: .5 .5  A=+1 model: ratio 1, kept         -> -1*1*log .5
    # t1: .8 .2  A=+1 model: p-m=.6 > δ: masked
    # t2: .3 .1  A=-1 model: p-m=+.2, A<0 kept; ratio 3 clipped to 2 -> +1*2*log .3
    # t3: .9 .9  A=-1 env token: never counts
    logp = _lp(0.5, 0.8, 0.3, 0.9).requires_grad_(True)
    mu = _lp(0.5, 0.2, 0.1, 0.9)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    model = torch.tensor([True, True, True, False])
    out = dppo_loss(logp, mu, adv, model, GateConfig(clip=2.0))
    expected = (-math.log(0.5) + 2 * math.log(0.3)) / 2
    assert out.loss.item() == pytest.approx(expected)
    assert out.tokens == 3
    assert out.masked_fraction == pytest.approx(1 / 3)
    assert out.mean_abs_diff == pytest.approx((0 + 0.6 + 0.2) / 3)
    kl = (math.log(0.5 / 0.5) + math.log(0.2 / 0.8) + math.log(0.1 / 0.3)) / 3
    assert out.mismatch_kl == pytest.approx(kl)
    out.loss.backward()
    # d/dlogp: -A*ratio/kept on kept tokens; the ratio is a constant (stop-gradient).
    assert logp.grad.tolist() == pytest.approx([-0.5, 0.0, 1.0, 0.0])


def test_loss_with_no_model_tokens_is_zero_and_differentiable():
    logp = _lp(0.5, 0.5).requires_grad_(True)
    out = dppo_loss(
        logp, logp.detach(), torch.ones(2, dtype=torch.float64), torch.tensor([False, False])
    )
    assert out.loss.item() == 0.0 and out.tokens == 0
    out.loss.backward()
    assert logp.grad.tolist() == [0.0, 0.0]


def test_on_policy_loss_is_the_policy_gradient():
    # With p == m nothing is masked and the ratio is 1: plain REINFORCE.
    logp = _lp(0.25, 0.5, 0.125)
    adv = torch.tensor([0.5, -0.5, 1.0], dtype=torch.float64)
    out = dppo_loss(logp, logp, adv, torch.tensor([True, True, True]))
    assert out.loss.item() == pytest.approx(float(-(adv * logp).mean()))
    assert out.masked_fraction == 0.0 and out.mismatch_kl == pytest.approx(0.0)


def test_warmup_lr_rises_linearly_then_holds():
    from colonnade.train.step import warmup_lr

    assert [warmup_lr(1e-3, v, 4) for v in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )
    assert warmup_lr(1e-3, 0, 0) == 1e-3  # no warm-up
